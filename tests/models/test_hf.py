"""hf:MODEL_TYPE from small configs and hf:PATH from local checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from opswap.errors import SpecError
from opswap.graph import capture, op_kind
from opswap.models import list_hf_types, load
from opswap.models.hf import hf_kinds

pytestmark = pytest.mark.hf

# The hand-tuned presets; list_hf_types() adds the generic types checked end to end
# (tests/models/test_hf_kinds.py covers a sample of each kind).
TEXT = {"bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2"}
VISION = {"vit", "resnet", "mobilenet_v2", "convnext"}
ATTENTION = TEXT | {"vit"}
REQUIRED = {
    "bert",
    "roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta-v2",
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "phi",
    "gemma",
    "opt",
    "gpt_neox",
    "falcon",
    "t5",
    "bart",
    "vit",
    "resnet",
    "convnext",
    "mobilenet_v2",
    "swin",
    "deit",
    "clip",
    "siglip",
}


def test_supported_types_cover_the_required_ones():
    types = list_hf_types()
    assert types[: len(TEXT | VISION)] == [
        "bert",
        "roberta",
        "distilbert",
        "gpt2",
        "llama",
        "mistral",
        "qwen2",
        "vit",
        "resnet",
        "mobilenet_v2",
        "convnext",
    ]  # the presets first
    assert REQUIRED <= set(types) and len(types) == len(set(types)) >= 25
    kinds = hf_kinds()
    assert list(kinds) == types
    assert set(kinds.values()) == {"encoder", "decoder", "encoder-decoder", "vision", "vision-text"}
    assert {t for t in TEXT | VISION if kinds[t] == "vision"} == VISION


@pytest.mark.parametrize("model_type", sorted(TEXT | VISION))
def test_loads_runs_and_captures(model_type):
    loaded = load(f"hf:{model_type}")
    assert loaded.source == "hf" and loaded.name == model_type
    assert not loaded.module.training
    x, *rest = loaded.example_inputs
    assert tuple(loaded.settings["inputs"]) == loaded.module.input_names
    assert len(loaded.module.input_names) == len(loaded.example_inputs)
    if model_type in TEXT:
        assert loaded.module.input_names[:2] == ("input_ids", "attention_mask")
        assert x.dtype == torch.int64 and tuple(x.shape) == (2, 32)
        assert 0 <= int(x.min()) and int(x.max()) < loaded.module.config.vocab_size
    else:
        assert loaded.module.input_names == ("pixel_values",) and not rest
        assert x.is_floating_point() and tuple(x.shape) == (2, 3, 32, 32)
    with torch.no_grad():
        out = loaded.module(*loaded.example_inputs)
    assert isinstance(out, tuple) and out
    assert all(isinstance(o, torch.Tensor) and torch.isfinite(o).all() for o in out)
    assert out[0].shape[0] == 2

    cap = capture(loaded.module, loaded.example_inputs)  # timed in benchmarks/bench_zoo.py
    assert cap.method in ("fx", "export")
    found = [op_kind(n) for n in cap.gm.graph.nodes]
    if model_type in ATTENTION:
        # eager attention: the softmax is in the graph, not hidden in an SDPA call
        assert found.count("softmax") == 2, model_type
        assert "attention" not in found
    else:
        assert "conv" in found
    with torch.no_grad():
        fresh = torch.randn_like(x) if x.is_floating_point() else torch.randint_like(x, 0, 1000)
        torch.testing.assert_close(cap.gm(fresh, *rest)[0], loaded.module(fresh, *rest)[0])


@pytest.mark.parametrize("model_type", [t for t in list_hf_types() if t not in TEXT | VISION])
def test_every_checked_type_builds_small_and_runs(model_type):
    # the end-to-end runs (optimize, verification) are listed in docs/models.md
    loaded = load(f"hf:{model_type}")
    assert loaded.settings["kind"] == hf_kinds()[model_type]
    assert sum(p.numel() for p in loaded.module.parameters()) < 1_000_000
    with torch.no_grad():
        out = loaded.module(*loaded.example_inputs)
    assert out and all(isinstance(o, torch.Tensor) and torch.isfinite(o).all() for o in out)
    assert out[0].shape[0] == 2


def test_sdpa_override_gives_fused_attention():
    loaded = load("hf:bert", {"attn_implementation": "sdpa"})
    found = [op_kind(n) for n in capture(loaded.module, loaded.example_inputs).gm.graph.nodes]
    assert found.count("attention") == 2 and "softmax" not in found


def test_deterministic_weights_and_inputs():
    a, b = load("hf:llama"), load("hf:llama")
    for (ka, va), (kb, vb) in zip(
        a.module.state_dict().items(), b.module.state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb), ka
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    c = load("hf:llama", {"seed": "3"})
    assert not torch.equal(a.module.model.lm_head.weight, c.module.model.lm_head.weight)


def test_overrides_reach_config_and_inputs():
    loaded = load(
        "hf:bert",
        {
            "num_hidden_layers": "3",
            "batch": "3",
            "seq": "11",
            "hidden_dropout_prob": "0",
            "vocab_size": "500",
        },
    )
    config = loaded.module.config
    assert config.num_hidden_layers == 3 and len(loaded.module.model.encoder.layer) == 3
    assert config.hidden_dropout_prob == 0.0 and config.vocab_size == 500
    assert tuple(loaded.example_inputs[0].shape) == (3, 11)
    assert int(loaded.example_inputs[0].max()) < 500
    with torch.no_grad():
        assert tuple(loaded.module(*loaded.example_inputs)[0].shape) == (3, 11, 64)


def test_config_aliases_are_accepted():
    loaded = load("hf:gpt2", {"hidden_size": "32", "num_attention_heads": "2"})
    assert (loaded.module.config.n_embd, loaded.module.config.n_head) == (32, 2)


def test_image_size_and_list_overrides():
    vit = load("hf:vit", {"image_size": "48", "batch": "1"})
    assert vit.module.config.image_size == 48
    assert tuple(vit.example_inputs[0].shape) == (1, 3, 48, 48)
    with torch.no_grad():
        assert tuple(vit.module(*vit.example_inputs)[0].shape) == (1, 10)
    res = load("hf:resnet", {"hidden_sizes": "[8, 16, 24, 32]", "image_size": "40"})
    assert res.module.config.hidden_sizes == [8, 16, 24, 32]
    assert tuple(res.example_inputs[0].shape) == (2, 3, 40, 40)
    with torch.no_grad():
        res.module(*res.example_inputs)


def test_bad_overrides():
    with pytest.raises(
        SpecError, match=r"Unknown override 'layers' for hf:bert.*batch.*BertConfig.*hidden_size"
    ):
        load("hf:bert", {"layers": "3"})
    with pytest.raises(SpecError, match="Unknown override 'to_dict'"):
        load("hf:bert", {"to_dict": "1"})  # a config method, not a field
    with pytest.raises(SpecError, match="num_hidden_layers for hf:bert must be an integer"):
        load("hf:bert", {"num_hidden_layers": "many"})
    with pytest.raises(SpecError, match="max_position_embeddings"):
        load("hf:llama", {"seq": "4096"})
    with pytest.raises(SpecError, match="seq for hf:gpt2 must be at least 1"):
        load("hf:gpt2", {"seq": "0"})


def test_unknown_type_lists_supported():
    with pytest.raises(
        SpecError, match=r"Unknown Hugging Face model type 'bret'.*bert.*gpt2.*llama.*vit"
    ):
        load("hf:bret")


def test_hub_ids_are_not_downloaded():
    with pytest.raises(SpecError, match="does not download"):
        load("hf:google-bert/bert-base-uncased")


def test_missing_transformers_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SpecError, match=r"pip install 'opswap\[hf\]'"):
        load("hf:bert")


# --------------------------------------------------------------------------- hf:PATH


def _check_round_trip(original, path):
    loaded = load(f"hf:{path}")
    assert loaded.source == "hf" and loaded.name == os.path.basename(path)
    assert type(loaded.module.model) is type(original.module.model)
    assert loaded.module.input_names == original.module.input_names
    gen = torch.Generator().manual_seed(11)
    x, *rest = original.example_inputs
    fresh = (
        torch.randint(0, 1000, x.shape, generator=gen)
        if not x.is_floating_point()
        else torch.randn(x.shape, generator=gen)
    )
    with torch.no_grad():
        for a, b in zip(loaded.module(fresh, *rest), original.module(fresh, *rest), strict=True):
            torch.testing.assert_close(a, b)
    return loaded


def test_local_checkpoint_round_trip_safetensors(tmp_path):
    original = load("hf:gpt2")
    path = tmp_path / "tiny-gpt2"
    original.module.model.save_pretrained(path)
    assert (path / "model.safetensors").exists()
    loaded = _check_round_trip(original, str(path))
    assert loaded.module.config.n_layer == 2


def test_local_checkpoint_vision_uses_saved_image_size(tmp_path):
    original = load("hf:vit", {"image_size": "40", "patch_size": "10"})
    path = tmp_path / "tiny-vit"
    original.module.model.save_pretrained(path)
    loaded = load(f"hf:{path}", {"batch": "1"})
    assert tuple(loaded.example_inputs[0].shape) == (1, 3, 40, 40)


def test_local_checkpoint_bin_loads_weights_only(tmp_path):
    original = load("hf:bert")
    path = tmp_path / "tiny-bert"
    original.module.model.save_pretrained(path)
    os.remove(path / "model.safetensors")
    torch.save(original.module.model.state_dict(), path / "pytorch_model.bin")
    _check_round_trip(original, str(path))

    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    state = dict(original.module.model.state_dict(), payload=Payload())
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(SpecError, match="pickled objects"):
        load(f"hf:{path}")
    assert not marker.exists()


def test_local_directory_errors(tmp_path):
    with pytest.raises(SpecError, match="no config.json"):
        load(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(SpecError, match="no weights"):
        load(f"hf:{tmp_path}")


# ------------------------------------------------------- hf:PATH for inference


def _tiny_lm(kind: str):
    import transformers as tf

    if kind == "llama":
        config = tf.LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=128,
        )
        model_class = tf.LlamaForCausalLM
    else:
        config = tf.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128)
        model_class = tf.GPT2LMHeadModel
    assert config.use_cache  # as a checkpoint saved for generation says
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return model_class(config).eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_saved_causal_lm_optimizes_and_the_result_matches_it(tmp_path, kind):
    from opswap import load_optimized
    from opswap.cli import main
    from opswap.models.hf_inputs import padded_mask

    user = _tiny_lm(kind)
    user.save_pretrained(tmp_path / kind)
    assert json.loads((tmp_path / kind / "config.json").read_text())["use_cache"] is True
    loaded = load(f"hf:{tmp_path / kind}")
    assert loaded.settings["use_cache"] is False  # noted, as the checkpoint said true
    try:
        main(
            [
                "optimize",
                f"hf:{tmp_path / kind}",
                "--compare",
                "none",
                "--samples",
                "1",
                "--no-bench",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    except SystemExit as e:
        assert e.code in (0, None), e.code
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["run"]["model_settings"]["use_cache"] is False
    saved = load_optimized(tmp_path / "out")
    gen = torch.Generator().manual_seed(8)
    ids, mask = torch.randint(0, 1000, (3, 19), generator=gen), padded_mask(3, 19)
    with torch.inference_mode():
        want = user(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = saved(ids, mask)[0]
    torch.testing.assert_close(got, want)
    # and in a fresh process, as a user deploys it
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    code = (
        "import sys, torch, opswap; m = opswap.load_optimized(sys.argv[1]); "
        "d = torch.load(sys.argv[2]); torch.save(m(d['ids'], d['mask'])[0], sys.argv[3])"
    )
    subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(tmp_path / "out"),
            str(tmp_path / "inputs.pt"),
            str(tmp_path / "logits.pt"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want)
    assert json.loads((tmp_path / kind / "config.json").read_text())["use_cache"] is True


def _checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    _tiny_lm("llama").save_pretrained(path)
    return path


def _refused(spec, capsys) -> str:
    from opswap.cli import main

    capsys.readouterr()  # what saving the checkpoint printed
    with pytest.raises(SystemExit) as done:
        main(["analyze", spec])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_config_that_is_not_json_is_one_line(tmp_path, capsys):
    path = _checkpoint(tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match=r"config.json .*not .*JSON"):
        load(f"hf:{path}")
    assert "config.json" in _refused(f"hf:{path}", capsys)


def test_an_unknown_model_type_is_one_line(tmp_path, capsys):
    path = _checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, model_type="llamma")))
    with pytest.raises(SpecError, match=r"model_type 'llamma'.*'llama'"):
        load(f"hf:{path}")
    assert "llamma" in _refused(f"hf:{path}", capsys)


def test_a_truncated_safetensors_file_is_one_line(tmp_path, capsys):
    path = _checkpoint(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SpecError, match=r"model.safetensors"):
        load(f"hf:{path}")
    assert "model.safetensors" in _refused(f"hf:{path}", capsys)


def test_missing_tensors_are_refused_by_name_unless_asked_for(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    path = _checkpoint(tmp_path)
    state = load_file(path / "model.safetensors")
    dropped = sorted(k for k in state if k.startswith("model.layers.1.mlp."))
    assert dropped
    save_file(
        {k: v for k, v in state.items() if k not in dropped},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(SpecError) as e:
        load(f"hf:{path}")
    assert f"{len(dropped)} missing" in str(e.value) and dropped[0] in str(e.value)
    assert dropped[0] in _refused(f"hf:{path}", capsys)

    loaded = load(f"hf:{path}", {"missing": "random"})  # the explicit opt-in
    assert sorted(loaded.settings["missing_weights"]) == dropped
    assert "random" in loaded.description


def test_a_capture_that_fails_on_a_cache_object_says_what_fixes_it(tmp_path):
    from opswap.errors import CaptureError

    _tiny_lm("gpt2").save_pretrained(tmp_path / "lm")
    loaded = load(f"hf:{tmp_path / 'lm'}", {"use_cache": "true"})  # the checkpoint's setting
    assert loaded.settings["use_cache"] is True
    with pytest.raises(CaptureError) as e:
        capture(loaded.module, loaded.example_inputs)
    msg = str(e.value)
    assert "DynamicCache" in msg and "use_cache=false" in msg and "\n" not in msg
    assert "Make that line traceable" not in msg  # the generic advice would not fix it


@pytest.mark.parametrize(
    ("spec", "names"),
    [("hf:gpt2", ("logits",)), ("hf:bert", ("last_hidden_state", "pooler_output"))],
)
def test_outputs_are_named_from_the_models_own_fields(spec, names):
    """HFModule returns a flat tuple; its outputs keep the model's field names, which the
    capture carries for exports (ONNX files name them so, not output_0)."""
    loaded = load(spec)
    assert loaded.module.opswap_output_names == names
    out = loaded.module(*loaded.example_inputs)
    assert len(out) == len(names)
    assert capture(loaded.module, loaded.example_inputs).gm.meta["opswap_output_names"] == names
