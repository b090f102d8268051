"""Example inputs for a Hugging Face model, named after its forward's parameters.

The inputs come in one fixed order per kind, recorded on the module
(`HFModule.input_names`) and in the loaded model's settings:

    encoder          input_ids, attention_mask, token_type_ids
    decoder          input_ids, attention_mask
    encoder-decoder  input_ids, attention_mask, decoder_input_ids
    vision           pixel_values
    vision-text      input_ids, pixel_values, attention_mask

An input is left out when forward has no parameter of that name; token_type_ids
only where the model has more than one segment type (bert, albert, electra; not
roberta or deberta-v2, whose type_vocab_size is 1 or 0); attention_mask when the
user asks for `mask=none`.

The attention mask is padded on the right, the way a tokenizer pads a batch to its
longest row: row i keeps `seq - i * step` tokens (at least one; step is
seq / (2 * batch), rounded down, at least 1), ones then zeros, so row 0 is full
and the others are shorter. Right padding suits decoders too: every position,
padded or not, attends to at least the first token, so no softmax row is fully
masked, and the real tokens keep positions 0, 1, ... as they would unpadded.
Padded positions of input_ids hold the pad token where the config names one.
token_type_ids mark two segments: type 0 up to half of each row's real length,
type 1 from there on. These shapes survive opswap's resizing and redrawing (see
graph.dynamic and verify.samples): masks and segment ids are cut or extended
along their rows and redrawn as new row lengths, never as noise.
"""

from __future__ import annotations

import inspect

import torch

from opswap.errors import SpecError

_ORDER = {
    "encoder": ("input_ids", "attention_mask", "token_type_ids"),
    "decoder": ("input_ids", "attention_mask"),
    "encoder-decoder": ("input_ids", "attention_mask", "decoder_input_ids"),
    "vision": ("pixel_values",),
    "vision-text": ("input_ids", "pixel_values", "attention_mask"),
}
ALL_INPUTS = ("input_ids", "pixel_values", "attention_mask", "token_type_ids", "decoder_input_ids")


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _vision_config(config):
    return getattr(config, "vision_config", None) or config


def input_names(model, kind: str, mask: bool, where: str) -> tuple[str, ...]:
    """The inputs opswap passes to `model`, in their fixed order."""
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    expected = _ORDER[kind][0] if kind != "vision-text" else "input_ids"
    if main != expected and not (kind == "vision-text" and main == "pixel_values"):
        raise SpecError(
            f"{where} takes '{main}', an input opswap cannot make from a config; load it through "
            f"a file.py:function spec that returns (model, inputs)."
        )
    text = _text_config(model.config)
    names = []
    for name in _ORDER[kind]:
        if name not in params:
            if name in ("input_ids", "pixel_values"):
                raise SpecError(
                    f"{where}'s forward takes no {name}, so opswap cannot call it; "
                    "load it through a file.py:function spec that returns (model, inputs)."
                )
            continue
        if name == "attention_mask" and not mask:
            continue
        if name == "token_type_ids" and (getattr(text, "type_vocab_size", 0) or 0) < 2:
            continue
        names.append(name)
    return tuple(names)


def lengths(batch: int, seq: int) -> list[int]:
    """Real lengths of the rows of a right-padded batch: the first full, then shorter."""
    step = max(1, seq // (2 * batch))
    return [max(1, seq - i * step) for i in range(batch)]


def padded_mask(batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] int64 attention mask: ones, then zeros for the padding."""
    keep = torch.tensor(lengths(batch, seq)).unsqueeze(1)
    return (torch.arange(seq).unsqueeze(0) < keep).to(torch.int64)


def make_inputs(
    names: tuple[str, ...], config, batch: int, seq: int, image: int, where: str
) -> tuple[torch.Tensor, ...]:
    """One tensor per name, drawn from torch's global generator (the caller seeds it)."""
    text, vision = _text_config(config), _vision_config(config)
    mask = padded_mask(batch, seq)
    made: dict[str, torch.Tensor] = {}
    for name in names:
        if name == "input_ids":
            vocab = getattr(text, "vocab_size", None)
            if not vocab:
                raise SpecError(f"{where} takes input_ids but its config has no vocab_size.")
            ids = torch.randint(0, vocab, (batch, seq), dtype=torch.int64)
            pad = getattr(text, "pad_token_id", None)
            if "attention_mask" in names and isinstance(pad, int) and 0 <= pad < vocab:
                ids = ids.masked_fill(mask == 0, pad)
            made[name] = ids
        elif name == "attention_mask":
            made[name] = mask
        elif name == "token_type_ids":
            half = torch.tensor([n // 2 for n in lengths(batch, seq)]).unsqueeze(1)
            made[name] = (torch.arange(seq).unsqueeze(0) >= half).to(torch.int64)
        elif name == "decoder_input_ids":
            vocab = getattr(config, "decoder_vocab_size", None) or text.vocab_size
            ids = torch.randint(0, vocab, (batch, seq), dtype=torch.int64)
            start = getattr(config, "decoder_start_token_id", None)
            if isinstance(start, int) and 0 <= start < vocab:
                ids[:, 0] = start
            made[name] = ids
        elif name == "pixel_values":
            channels = getattr(vision, "num_channels", 3)
            made[name] = torch.randn(batch, channels, image, image)
    return tuple(made[n] for n in names)
