"""--weights FILE: safetensors and torch.save state dicts loaded into a spec's architecture."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch
from safetensors.torch import save_file, save_model

from opswap.cli import main
from opswap.errors import SpecError
from opswap.models import load
from opswap.models.weights import best_fit


def _outputs(loaded, inputs=None):
    with torch.no_grad():
        out = loaded.module(*(inputs or loaded.example_inputs))
    return out[0] if isinstance(out, tuple) else out


def _save(module, path):
    if str(path).endswith(".safetensors"):
        save_model(module, str(path))  # drops the duplicates of tied tensors, as HF does
    else:
        torch.save(module.state_dict(), path)
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_zoo_round_trip(tmp_path, suffix):
    source = load("zoo:resnet", {"seed": "7"})
    path = _save(source.module, tmp_path / f"w{suffix}")
    fresh = load("zoo:resnet")
    loaded = load("zoo:resnet", weights=path)
    x = torch.randn_like(source.example_inputs[0])
    assert not torch.equal(_outputs(fresh, (x,)), _outputs(source, (x,)))  # seeds differ
    assert torch.equal(_outputs(loaded, (x,)), _outputs(source, (x,)))
    assert loaded.settings["weights"]["file"] == str(path)
    assert loaded.settings["weights"]["keys"] == "as saved"
    assert f"weights from w{suffix}" in loaded.description


@pytest.mark.hf
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_hf_round_trip_through_the_wrapper(tmp_path, suffix):
    source = load("hf:bert", {"seed": "3"})
    path = _save(source.module, tmp_path / f"w{suffix}")
    loaded = load("hf:bert", weights=path)
    assert torch.equal(_outputs(loaded, source.example_inputs), _outputs(source))
    assert loaded.description.endswith(f"weights from w{suffix}")  # "random weights" is gone


@pytest.mark.hf
def test_bare_hf_model_keys_load_with_the_prefix_said(tmp_path):
    source = load("hf:bert", {"seed": "3"})
    path = _save(source.module.model, tmp_path / "bare.safetensors")  # no "model." prefix
    loaded = load("hf:bert", weights=path)
    assert torch.equal(_outputs(loaded, source.example_inputs), _outputs(source))
    assert loaded.settings["weights"]["keys"] == "'model.' added"
    assert "keys read with 'model.' added" in loaded.description


@pytest.mark.hf
def test_tied_lm_head_is_not_missing(tmp_path):
    source = load("hf:gpt2", {"seed": "5"})
    path = _save(source.module.model, tmp_path / "gpt2.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) != ("transformer.wte.weight" in keys)  # one of the pair
    loaded = load("hf:gpt2", weights=path)
    assert torch.equal(_outputs(loaded, source.example_inputs), _outputs(source))


@pytest.mark.hf
def test_shape_mismatch_names_the_sizes_to_set(tmp_path):
    source = load("hf:bert", {"vocab_size": "1200"})
    path = _save(source.module.model, tmp_path / "w.safetensors")
    with pytest.raises(SpecError) as e:
        load("hf:bert", weights=path)
    assert str(e.value) == (
        "w.safetensors does not fit hf:bert (its keys read with 'model.' added): 1 shape "
        "mismatch (model.embeddings.word_embeddings.weight: file 1200x64, model 1000x64) — "
        "build the model with the file's sizes, e.g. --set vocab_size=1200."
    )
    assert torch.equal(  # and the hint is right
        _outputs(load("hf:bert", {"vocab_size": "1200"}, weights=path)), _outputs(source)
    )


@pytest.mark.hf
def test_more_layers_in_the_file(tmp_path):
    path = _save(load("hf:bert", {"num_hidden_layers": "3"}).module, tmp_path / "w.pt")
    with pytest.raises(
        SpecError,
        match=r"w.pt does not fit hf:bert: 16 unexpected keys "
        r"\(model.encoder.layer.2.attention.self.query.weight, .*, \.\.\.\), the "
        r"file has 3 model.encoder.layer blocks, the model 2 — build the model "
        r"with the file's sizes, e.g. --set num_hidden_layers=3\.$",
    ):
        load("hf:bert", weights=path)


def test_missing_and_unexpected_keys(tmp_path):
    state = load("zoo:resnet").module.state_dict()
    head = [k for k in state if k.startswith("fc.")]
    assert head
    for k in head:
        del state[k]
    state["extra.weight"] = torch.ones(3)
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(SpecError) as e:
        load("zoo:resnet", weights=tmp_path / "w.pt")
    msg = str(e.value)
    assert msg.startswith(f"w.pt does not fit zoo:resnet: {len(head)} missing keys ({head[0]}, ")
    assert "1 unexpected key (extra.weight)" in msg and msg.count(".") >= 3
    assert "check that the file was saved from this architecture" in msg


def test_file_of_another_architecture(tmp_path):
    save_file({"encoder.weight": torch.randn(2, 2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(
        SpecError,
        match=r"does not fit zoo:resnet: \d+ missing keys .*1 "
        r"unexpected key \(encoder.weight\)",
    ):
        load("zoo:resnet", weights=tmp_path / "w.safetensors")


class Payload:
    """Unpickling this would run code: torch.load(weights_only=True) must refuse it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_with_objects_is_refused_without_running_them(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "w.pt"
    torch.save({"fc.weight": torch.ones(2), "payload": Payload(str(marker))}, path)
    with pytest.raises(
        SpecError,
        match=r"^w.pt holds a pickled [\w.]*open, which opswap does "
        r"not unpickle; save model.state_dict\(\) alone",
    ):
        load("zoo:resnet", weights=path)
    assert not marker.exists()


def test_non_tensor_values_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": {"fc.weight": torch.ones(2)}, "epoch": 3}, path)
    with pytest.raises(
        SpecError,
        match=r"ckpt.pt holds 'state_dict' \(a dict\) besides tensors "
        r"\(a training checkpoint\?\); save model.state_dict\(\) alone\.",
    ):
        load("zoo:resnet", weights=path)


def test_unreadable_and_missing_files(tmp_path):
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(SpecError, match="junk.pt is neither a safetensors file nor a torch.save"):
        load("zoo:resnet", weights=tmp_path / "junk.pt")
    (tmp_path / "junk.safetensors").write_bytes(b"\x01")
    with pytest.raises(SpecError, match="could not be read as a safetensors file"):
        load("zoo:resnet", weights=tmp_path / "junk.safetensors")
    with pytest.raises(SpecError, match="does not exist; check the path after --weights"):
        load("zoo:resnet", weights=tmp_path / "nope.pt")


def test_pt2_specs_carry_their_weights(tmp_path):
    with pytest.raises(
        SpecError, match="model.pt2 is a saved program that carries its own weights; drop --weights"
    ):
        load(str(tmp_path / "model.pt2"), weights=tmp_path / "w.pt")


def test_weights_take_the_models_dtype(tmp_path):
    source = load("zoo:resnet", {"seed": "2"})
    half = {
        k: v.half() if v.is_floating_point() else v for k, v in source.module.state_dict().items()
    }
    save_file(half, str(tmp_path / "w16.safetensors"))
    loaded = load("zoo:resnet", weights=tmp_path / "w16.safetensors")
    weight = loaded.module.state_dict()["fc.weight"]
    assert weight.dtype == torch.float32
    assert torch.equal(weight, half["fc.weight"].float())
    assert loaded.settings["weights"]["file_dtypes"] == ["float16", "int64"]


def test_prefix_choice():
    model = ["model.a.weight", "model.b.weight", "model.c.bias"]
    assert best_fit(["a.weight", "b.weight", "c.bias"], model).describe() == "'model.' added"
    assert (
        best_fit(["module.model.a.weight", "module.model.b.weight"], model).describe()
        == "'module.' removed"
    )
    assert best_fit(model, model).describe() == ""


def test_file_spec_with_keyword_inputs_takes_bare_weights(tmp_path):
    (tmp_path / "m.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x, *, scale=1.0):
                return self.fc(x) * scale

        def build(seed=0):
            torch.manual_seed(seed)
            return Net(), (torch.randn(2, 4),), {"scale": 2.0}
    """)
    )
    source = load(f"{tmp_path / 'm.py'}:build", {"seed": "4"})
    torch.save(source.module.model.state_dict(), tmp_path / "net.pt")  # the user's own model
    loaded = load(f"{tmp_path / 'm.py'}:build", weights=tmp_path / "net.pt")
    assert loaded.settings["weights"]["keys"] == "'model.' added"
    assert torch.equal(_outputs(loaded, source.example_inputs), _outputs(source))


def test_cli_weights(tmp_path, capsys):
    source = load("zoo:resnet", {"seed": "9"})
    path = _save(source.module, tmp_path / "w.safetensors")
    plan = tmp_path / "plan.json"
    assert (
        _run(
            "plan",
            "zoo:resnet",
            "--weights",
            str(path),
            "--rules",
            "fusion.conv_bn",
            "--out",
            str(plan),
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long paths
    assert f"weights: {path} (" in out
    assert _run("verify", "zoo:resnet", str(plan), "--weights", str(path), "--samples", "1") == 0
    bad = tmp_path / "bad.pt"
    torch.save({"fc.weight": torch.ones(2, 2)}, bad)
    assert _run("analyze", "zoo:resnet", "--weights", str(bad)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad.pt does not fit zoo:resnet: ") and "Traceback" not in err


def _run(*args):
    try:
        main(list(args))
    except SystemExit as e:
        return e.code or 0
    return 0


@pytest.mark.hf
def test_hint_tells_sizes_that_share_a_value_apart(tmp_path):
    # in hf:bert's small config intermediate_size and max_position_embeddings are both 128
    sizes = {"hidden_size": "96", "intermediate_size": "192", "max_position_embeddings": "160"}
    path = _save(load("hf:bert", sizes).module, tmp_path / "w.pt")
    with pytest.raises(SpecError) as e:
        load("hf:bert", weights=path)
    msg = str(e.value)
    hint = msg[msg.index("e.g. ") + 5 :]
    assert hint.endswith(" (and num_attention_heads, which the weights do not show).")
    assert set(re.findall(r"--set (\w+=\d+)", hint)) == {f"{k}={v}" for k, v in sizes.items()}
    assert load("hf:bert", sizes, weights=path).settings["weights"]["keys"] == "as saved"


@pytest.mark.hf
def test_tied_names_that_disagree_in_the_file_are_refused(tmp_path):
    # gpt2 ties lm_head.weight to transformer.wte.weight: copying both into the one tensor
    # would keep the head's values and silently drop the file's embedding
    source = load("hf:gpt2", {"seed": "5"})
    state = {k: v.clone() for k, v in source.module.model.state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["transformer.wte.weight"])
    torch.save(state, tmp_path / "untied.pt")
    with pytest.raises(SpecError) as e:
        load("hf:gpt2", weights=tmp_path / "untied.pt")
    msg = str(e.value)
    assert "lm_head.weight" in msg and "transformer.wte.weight" in msg and "tie" in msg
    assert msg.startswith("untied.pt ") and msg.endswith(".") and "\n" not in msg
    untied = load("hf:gpt2", {"tie_word_embeddings": "false"}, weights=tmp_path / "untied.pt")
    original = type(source.module.model)(untied.module.config).eval()  # the file's own model
    original.load_state_dict(state)
    with torch.no_grad():
        want = original(*source.example_inputs[:1], attention_mask=source.example_inputs[1])
    torch.testing.assert_close(_outputs(untied, source.example_inputs), want.logits)

    state["lm_head.weight"] = state["transformer.wte.weight"].clone()  # equal copies are fine
    torch.save(state, tmp_path / "tied.pt")
    loaded = load("hf:gpt2", weights=tmp_path / "tied.pt")
    assert torch.equal(_outputs(loaded, source.example_inputs), _outputs(source))
