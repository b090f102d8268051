"""hf:MODEL_TYPE for every kind: generic small configs, inputs from the forward's
signature with a padded attention mask, captures that hold on other padded batches."""

from __future__ import annotations

import pytest
import torch

from opswap.errors import SpecError
from opswap.graph import capture
from opswap.graph.dynamic import step_rows
from opswap.models import list_hf_types, load
from opswap.models.hf import hf_config, hf_kinds
from opswap.models.hf_inputs import make_inputs

pytestmark = pytest.mark.hf

# Two of each kind (bert, gpt2-style presets and generic types mixed), one vision-text.
SAMPLE = {
    "bert": ("encoder", ("input_ids", "attention_mask", "token_type_ids")),
    "electra": ("encoder", ("input_ids", "attention_mask", "token_type_ids")),
    "opt": ("decoder", ("input_ids", "attention_mask")),
    "gemma": ("decoder", ("input_ids", "attention_mask")),
    "t5": ("encoder-decoder", ("input_ids", "attention_mask", "decoder_input_ids")),
    "bart": ("encoder-decoder", ("input_ids", "attention_mask", "decoder_input_ids")),
    "vit": ("vision", ("pixel_values",)),
    "deit": ("vision", ("pixel_values",)),
    "clip": ("vision-text", ("input_ids", "pixel_values", "attention_mask")),
}


def _check_mask(mask: torch.Tensor) -> None:
    assert mask.dtype == torch.int64 and set(mask.unique().tolist()) == {0, 1}
    assert not bool((mask == 1).all())  # real padding
    assert bool((mask[:, 0] == 1).all())  # every row starts with a token
    assert step_rows(mask) == "head"  # ones, then zeros
    lengths = mask.sum(1)
    assert lengths[0] == mask.shape[1] and len(set(lengths.tolist())) == mask.shape[0]


@pytest.mark.parametrize("model_type", list(SAMPLE))
def test_inputs_follow_the_signature_and_captures_hold_on_padded_batches(model_type):
    kind, names = SAMPLE[model_type]
    loaded = load(f"hf:{model_type}")
    assert hf_kinds()[model_type] == kind == loaded.settings["kind"]
    assert loaded.module.input_names == names and loaded.settings["inputs"] == list(names)
    inputs = dict(zip(names, loaded.example_inputs, strict=True))
    config = loaded.module.config
    if "attention_mask" in inputs:
        _check_mask(inputs["attention_mask"])
        assert inputs["input_ids"].shape == inputs["attention_mask"].shape == (2, 32)
    if "token_type_ids" in inputs:
        types = inputs["token_type_ids"]
        assert set(types.unique().tolist()) == {0, 1} and step_rows(types) == "tail"
    if "decoder_input_ids" in inputs:
        assert inputs["decoder_input_ids"].shape == (2, 32)
        assert int(inputs["decoder_input_ids"].max()) < config.vocab_size
    if "pixel_values" in inputs:
        assert inputs["pixel_values"].shape[:2] == (2, 3)
    with torch.no_grad():
        out = loaded.module(*loaded.example_inputs)
    assert out and all(torch.isfinite(o).all() for o in out if isinstance(o, torch.Tensor))

    cap = capture(loaded.module, loaded.example_inputs)
    axes = [a.name for a in cap.dynamic.axes]
    assert axes == (["batch"] if kind == "vision" else ["batch", "seq"]), cap.notes
    # Another padded batch, at another batch size and sequence length.
    image = loaded.settings["image_size"]
    with torch.random.fork_rng():
        torch.manual_seed(5)
        other = make_inputs(names, config, 3, 20, image, model_type)
    if "attention_mask" in names:
        _check_mask(other[names.index("attention_mask")])
    with torch.no_grad():
        want, got = loaded.module(*other), cap.gm(*other)
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        assert w.shape[0] == 3
        torch.testing.assert_close(g, w)


def test_the_mask_reaches_an_encoder():
    loaded = load("hf:electra")
    ids, mask, types = loaded.example_inputs
    n = int(mask[1].sum())
    assert n < ids.shape[1]

    def hidden(ids, mask=mask):
        with torch.no_grad():
            return loaded.module(ids, mask, types)[0][1, :n]

    padded, real = ids.clone(), ids.clone()
    padded[1, n:] = (ids[1, n:] + 7) % 1000  # only padded-out tokens change
    real[1, 0] = (ids[1, 0] + 7) % 1000
    torch.testing.assert_close(hidden(padded), hidden(ids))
    assert not torch.allclose(hidden(real), hidden(ids))  # the check can tell a change
    assert not torch.allclose(
        hidden(padded, torch.ones_like(mask)), hidden(ids, torch.ones_like(mask))
    )


def test_mask_none_leaves_the_mask_out():
    loaded = load("hf:bert", {"mask": "none"})
    assert loaded.module.input_names == ("input_ids", "token_type_ids")
    assert loaded.settings["mask"] == "none"
    assert load("hf:gpt2", {"mask": "none"}).module.input_names == ("input_ids",)
    with pytest.raises(SpecError, match="mask for hf:bert must be padded or none"):
        load("hf:bert", {"mask": "left"})


def test_every_checked_type_has_a_small_consistent_config():
    for model_type in list_hf_types():
        config = hf_config(model_type)
        for c in (
            config,
            getattr(config, "text_config", None),
            getattr(config, "vision_config", None),
        ):
            if c is None:
                continue
            hidden = getattr(c, "hidden_size", None)
            heads = getattr(c, "num_attention_heads", None)
            assert getattr(c, "num_hidden_layers", 0) <= 4, model_type
            assert getattr(c, "vocab_size", 0) <= 1000, model_type
            if isinstance(hidden, int) and isinstance(heads, int):
                assert hidden <= 128 and hidden % heads == 0, model_type
                kv = getattr(c, "num_key_value_heads", None)
                assert kv is None or heads % kv == 0, model_type
                head_dim = getattr(c, "head_dim", None)
                assert head_dim is None or head_dim * heads == hidden, model_type


def test_size_full_is_the_default_config():
    small, full = hf_config("electra"), hf_config("electra", {"size": "full"})
    assert (small.hidden_size, small.num_hidden_layers, small.vocab_size) == (64, 2, 1000)
    assert (full.hidden_size, full.num_hidden_layers, full.vocab_size) == (256, 12, 30522)
    clip = hf_config("clip", {"size": "full"})
    assert (clip.text_config.hidden_size, clip.vision_config.image_size) == (512, 224)
    assert hf_config("clip").text_config.hidden_size == 64
    assert hf_config("bert", {"size": "full"}).hidden_size == 768  # presets too
    assert hf_config("llama", {"size": "full", "num_hidden_layers": "3"}).num_hidden_layers == 3
    with pytest.raises(SpecError, match="size for hf:bert must be small or full"):
        hf_config("bert", {"size": "huge"})


def test_a_type_opswap_cannot_feed_is_refused_in_one_sentence():
    with pytest.raises(SpecError) as info:
        load("hf:wav2vec2")
    message = str(info.value)
    assert message.startswith("hf:wav2vec2 takes 'input_values', an input opswap cannot make")
    assert "\n" not in message and ". " not in message and message.endswith(".")
    with pytest.raises(SpecError, match=r"Unknown Hugging Face model type 'lama'.*'llama'"):
        load("hf:lama")


def test_an_unlisted_type_goes_through_the_generic_path():
    assert "ernie" not in list_hf_types()
    loaded = load("hf:ernie", {"seq": "12"})
    assert loaded.settings["kind"] == "encoder" and loaded.module.config.hidden_size == 64
    assert loaded.example_inputs[0].shape == (2, 12)
