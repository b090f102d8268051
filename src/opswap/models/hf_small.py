"""Small configs for any `hf:MODEL_TYPE`, and which kind of model a type is.

`shrink(config)` reads a transformers default config's own fields and returns the
keyword arguments that rebuild it small: 2 layers, hidden 64 with 4 heads of 16,
feed-forward 128, vocabulary 1000, 128 positions, 32-pixel images with 8-pixel
patches, stage widths of at most 128. Fields are found by the role the config's
`attribute_map` gives them (gpt2's `n_embd` is its `hidden_size`) or by the names
transformers uses for that role, and every field that held the old hidden size,
head size, feed-forward size or patch size gets the new one (opt's
`word_embed_proj_dim`, gemma2's `query_pre_attn_scalar`, vit's `encoder_stride`).
Only declared fields are passed back, so what a config derives in `__post_init__`
(swin's `hidden_size`, qwen2's `layer_types`) is derived again from the small values.
Sub-configs (`text_config`, `vision_config`, ...) are shrunk the same way.
Sizes that other sizes depend on stay consistent: per-stage channel lists are
divided like `hidden_sizes` (hgnet_v2, textnet), widths a width coefficient made
follow the new coefficient (efficientnet's `hidden_dim`), GroupNorm's group count
divides every width (bit), and the image stays large enough for the net's own
downsampling (mobilevitv2) or tiles its fixed mask units (hiera).

`kind(model_type)` sorts a type by transformers' auto mappings: a vision-text
model (zero-shot image classification: clip, siglip), an encoder-decoder, a
decoder (causal LM that is not also a masked LM; bert has a causal LM head too), a
vision model (image classification), or an encoder; it also names the Auto class.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

HIDDEN, HEAD_DIM, FFN, VOCAB, POSITIONS, LAYERS = 64, 16, 128, 1000, 128, 2
IMAGE, PATCH, MAX_WIDTH, EXPERTS, EXPERTS_PER_TOKEN = 32, 8, 128, 4, 2

# Names transformers uses for one role, beside what `attribute_map` says.
_LAYERS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
)
_HIDDEN = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim")
_HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_HEAD_DIM = ("head_dim", "d_kv", "kv_channels")
_FFN = (
    "intermediate_size",
    "ffn_dim",
    "d_ff",
    "n_inner",
    "hidden_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "ffn_hidden_size",
)
_MOE_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_VOCAB = ("vocab_size", "decoder_vocab_size")
_POSITIONS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_target_positions",
    "max_source_positions",
    "original_max_position_embeddings",
)
_MULTIPLIERS = {
    "depth_multiplier": 0.35,
    "width_coefficient": 0.25,
    "depth_coefficient": 0.5,
    "width_multiplier": 0.5,
}
# Integer fields named like a width: shrunk when they held the old hidden, head,
# feed-forward or patch size.
_WIDTH_WORDS = ("size", "dim", "embd", "proj", "scalar", "stride", "width")
_NOT_WIDTH = (
    "vocab",
    "position",
    "token",
    "label",
    "layer",
    "bucket",
    "window",
    "image",
    "chunk",
    "kernel",
    "num_",
    "max_",
    "group",
)


def _fields(config) -> dict[str, Any]:
    if dataclasses.is_dataclass(config):
        names = [f.name for f in dataclasses.fields(config)]
    else:  # an older config class that is not a dataclass
        names = list(config.to_dict())
    return {n: getattr(config, n) for n in names if not n.startswith("_") and hasattr(config, n)}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(_is_int(x) for x in v)


def _is_config(v) -> bool:
    return hasattr(v, "to_dict") and hasattr(v, "model_type")


def _round8(v: float) -> int:
    return max(8, int(round(v / 8)) * 8)


def _divisor(width: int, at_most: int) -> int:
    """The largest head count <= at_most that divides width."""
    return next(h for h in range(max(1, at_most), 0, -1) if width % h == 0)


class _Fields:
    """A config's declared fields, found by role: the name its `attribute_map` gives the
    role (gpt2: hidden_size -> n_embd) first, then transformers' usual names for it."""

    def __init__(self, config):
        self.values = _fields(config)
        self.amap = dict(getattr(config, "attribute_map", {}) or {})

    def get(self, name: str):
        return self.values.get(name)

    def find(self, role: str, names: tuple[str, ...]) -> list[str]:
        found = [self.amap[role]] if role in self.amap else []
        return [n for n in dict.fromkeys(found + list(names)) if n in self.values]

    def ints(self, role: str, names: tuple[str, ...]) -> list[str]:
        return [n for n in self.find(role, names) if _is_int(self.values[n])]

    def first(self, role: str, names: tuple[str, ...]) -> tuple[str | None, int | None]:
        found = self.ints(role, names)
        return (found[0], self.values[found[0]]) if found else (None, None)


def shrink(config) -> dict[str, Any]:
    """Keyword arguments that rebuild `config` (a transformers config) at small sizes."""
    f = _Fields(config)
    out: dict[str, Any] = {n: shrink(v) for n, v in f.values.items() if _is_config(v)}
    old: dict[int, int] = {}  # old size -> new size, for other fields that held it
    staged = _ints(f.get("depths"))
    if staged:
        # staged vision nets: one block per stage; their layer count is the number of
        # stages, which stays
        out["depths"] = [1] * len(f.get("depths"))
    else:
        for n in f.ints("num_hidden_layers", _LAYERS):
            if f.get(n) > LAYERS:
                out[n] = LAYERS
    if _is_int(f.get("max_window_layers")):
        out["max_window_layers"] = min(f.get("max_window_layers"), LAYERS)
    widths = _stage_widths(f, staged, out)
    if widths is not None:
        for n in f.find("num_attention_heads", _HEADS):
            if _ints(f.get(n)) and len(f.get(n)) == len(widths):
                out[n] = [
                    _divisor(w, min(h, max(1, w // HEAD_DIM)))
                    for w, h in zip(widths, f.get(n), strict=True)
                ]
    else:
        _transformer(f, out, old)
    _tables(f, out)
    _images(f, staged, out, old)
    for n, at_most in _MULTIPLIERS.items():  # mobilenet and efficientnet widths and depths
        if isinstance(f.get(n), (int, float)) and not isinstance(f.get(n), bool):
            out[n] = min(f.get(n), at_most)
            if n == "width_coefficient" and out[n] != f.get(n):
                _scaled_widths(f, f.get(n), out[n], out)
    _groups(f, out)
    for n, v in f.values.items():
        if (
            n not in out
            and _is_int(v)
            and v in old
            and any(w in n for w in _WIDTH_WORDS)
            and not any(w in n for w in _NOT_WIDTH)
        ):
            out[n] = old[v]
    if "vocab_size" in out:
        _fit_token_ids(f.values, out["vocab_size"], out)
    return out


def _stage_widths(f: _Fields, staged: bool, out: dict[str, Any]) -> list[int] | None:
    """New per-stage widths of a staged net (None for a plain transformer): `hidden_sizes`
    divided down to at most MAX_WIDTH, or swin's embed_dim * 2**i."""
    for n, v in f.values.items():  # mobilevit's neck_hidden_sizes too
        if n.endswith("hidden_sizes") and _ints(v) and max(v) > MAX_WIDTH:
            out[n] = [_round8(w / math.ceil(max(v) / MAX_WIDTH)) for w in v]
    widths = f.get("hidden_sizes")
    if _ints(widths):
        factor = math.ceil(max(widths) / MAX_WIDTH)
        if factor > 1:
            for n in ("embedding_size", "groups_width", "decoder_hidden_size"):
                if _is_int(f.get(n)):
                    out[n] = _round8(f.get(n) / factor)
            _channels(f, factor, out)
        return out.get("hidden_sizes", list(widths))
    name, h0 = f.first("hidden_size", _HIDDEN)
    if staged and name == "embed_dim":
        stages = len(f.get("depths"))
        out["embed_dim"] = _round8(h0 / math.ceil(h0 * 2 ** (stages - 1) / MAX_WIDTH))
        return [out["embed_dim"] * 2**i for i in range(stages)]
    return None


def _channels(f: _Fields, factor: int, out: dict[str, Any]) -> None:
    """Per-stage channel fields divided like hidden_sizes (hgnet_v2's stage_out_channels
    feed its classifier, which reads hidden_sizes[-1]; textnet's stem_out_channels feed
    its first stage): each old width maps to one new one, so widths that met still meet;
    the image's own channel count stays."""
    image = next((f.get(n) for n in ("num_channels", "stem_num_channels") if _is_int(f.get(n))), 3)

    def one(v: int) -> int:
        return v if v == image else _round8(v / factor)

    for n, v in f.values.items():
        if n in out or "channels" not in n or "num_" in n:
            continue
        if _is_int(v) and v > 0:
            out[n] = one(v)
        elif _ints(v):
            out[n] = [one(x) for x in v]


def _scaled_widths(f: _Fields, was: float, now: float, out: dict[str, Any]) -> None:
    """Widths a config stores already multiplied by its width coefficient (efficientnet's
    hidden_dim is round_filters(1280), the last conv's width) follow the new coefficient,
    rounded as round_filters rounds (to depth_divisor, never below 90%)."""
    divisor = f.get("depth_divisor") if _is_int(f.get("depth_divisor")) else 8
    for n, v in f.values.items():
        if (
            n in out
            or not _is_int(v)
            or v <= 0
            or not any(w in n for w in ("dim", "size"))
            or any(w in n for w in _NOT_WIDTH)
        ):
            continue
        base = v / was
        if base != int(base):
            continue  # not a width the coefficient made
        want = base * now
        new = max(divisor, int(want + divisor / 2) // divisor * divisor)
        out[n] = new + divisor if new < 0.9 * want else new


def _groups(f: _Fields, out: dict[str, Any]) -> None:
    """GroupNorm's group count (bit's num_groups=32) divides every shrunk width."""
    groups = f.get("num_groups")
    if not _is_int(groups) or groups < 2:
        return
    widths = [out[n] for n in ("embedding_size", "hidden_sizes") if n in out]
    flat = [w for v in widths for w in (v if isinstance(v, list) else [v]) if _is_int(w)]
    if flat:
        out["num_groups"] = _divisor(math.gcd(*flat), groups)


def _transformer(f: _Fields, out: dict[str, Any], old: dict[int, int]) -> None:
    """Hidden size, heads (query and key-value), head size, feed-forward and expert sizes."""
    name, h0 = f.first("hidden_size", _HIDDEN)
    if name is not None:
        assert h0 is not None  # first() finds a name and its int together
        hidden = min(h0, HIDDEN)
        out[name] = old[h0] = hidden
        _, heads0 = f.first("num_attention_heads", _HEADS)
        heads = _divisor(hidden, min(heads0 or 1, max(1, hidden // HEAD_DIM)))
        for n in f.ints("num_attention_heads", _HEADS):
            out[n] = heads
        head_dim = hidden // heads
        hd0 = next(
            (f.get(n) for n in f.ints("head_dim", _HEAD_DIM)), h0 // heads0 if heads0 else None
        )
        for n in f.find("head_dim", _HEAD_DIM):
            out[n] = head_dim  # also where None stood for hidden // heads
        if hd0:
            old.setdefault(hd0, head_dim)
            if _is_int(f.get("rotary_dim")):  # gptj, codegen: the same share of each head
                out["rotary_dim"] = max(2, f.get("rotary_dim") * head_dim // hd0 // 2 * 2)
        for n in f.ints("num_key_value_heads", _KV_HEADS):
            if heads0:
                kv = max(1, round(heads * f.get(n) / heads0))
                out[n] = kv if heads % kv == 0 else 1
        for n in f.ints("intermediate_size", _FFN):
            old.setdefault(f.get(n), FFN)
            out[n] = min(f.get(n), FFN)
        for n in _MOE_FFN:
            if _is_int(f.get(n)):
                out[n] = min(f.get(n), FFN // 2)
        if _is_int(f.get("embedding_size")):  # albert, electra: a narrower embedding
            out["embedding_size"] = min(f.get("embedding_size"), hidden)
    for n in _EXPERTS:
        if _is_int(f.get(n)):
            out[n] = min(f.get(n), EXPERTS)
    if _is_int(f.get("num_experts_per_tok")):
        out["num_experts_per_tok"] = min(f.get("num_experts_per_tok"), EXPERTS_PER_TOKEN)


def _tables(f: _Fields, out: dict[str, Any]) -> None:
    """Vocabulary, position table and projection sizes."""
    for n in f.ints("vocab_size", _VOCAB):
        out[n] = min(f.get(n), VOCAB)
    for n in f.ints("max_position_embeddings", _POSITIONS):
        out[n] = min(f.get(n), POSITIONS)
    if _is_int(f.get("projection_dim")):
        out["projection_dim"] = min(f.get("projection_dim"), HIDDEN)


def _images(f: _Fields, staged: bool, out: dict[str, Any], old: dict[int, int]) -> None:
    """Image, patch and window sizes."""
    image, patch, window = f.get("image_size"), f.get("patch_size"), f.get("window_size")
    if _ints(image) and len(set(image)) == 1:
        _image_list(f, out)
        return
    if not _is_int(image):
        return
    if not staged:
        out["image_size"] = min(image, IMAGE)
        if _is_int(f.get("output_stride")) and _is_int(patch):
            # mobilevitv2 unfolds patches of its last, output_stride-times smaller map
            out["image_size"] = min(image, max(IMAGE, f.get("output_stride") * patch))
        if _is_int(patch) and patch > PATCH:
            out["patch_size"] = old[patch] = PATCH
    elif _is_int(patch) and _is_int(window):
        # swin: the stem's patch kept, an image large enough that the last stage is still
        # 2 wide, windows that fit it (transformers cannot shrink a window below the
        # size its position bias was built for)
        halvings = 2 ** (len(f.get("depths")) - 1)
        out["image_size"] = min(image, max(IMAGE, 2 * patch * halvings))
        out["window_size"] = max(1, min(window, out["image_size"] // patch // halvings))
    else:  # the stem's patch size is fixed by design (levit's is 16)
        out["image_size"] = min(image, IMAGE)


def _image_list(f: _Fields, out: dict[str, Any]) -> None:
    """A fixed [height, width] image (hiera's position table is built for it): the
    smallest that the patch stride times the mask unit still tiles, at least IMAGE."""
    image = f.get("image_size")
    unit = 1
    for n in ("patch_stride", "masked_unit_size"):
        if _ints(f.get(n)):
            unit *= f.get(n)[0]
    side = min(image[0], max(unit, IMAGE // unit * unit))
    out["image_size"] = [side] * len(image)


def _fit_token_ids(values: dict[str, Any], vocab: int, out: dict[str, Any]) -> None:
    """Special token ids past the smaller vocabulary move to its top ids, one per old id."""
    taken: dict[int, int] = {}

    def fit(i):
        if not _is_int(i) or i < vocab:
            return i
        if i not in taken:
            taken[i] = vocab - 1 - len(taken)
        return taken[i]

    for n, v in values.items():
        if n.endswith(("_token_id", "_token_index")):
            if _is_int(v):
                out[n] = fit(v)
            elif _ints(v):
                out[n] = [fit(i) for i in v]


# ----------------------------------------------------------------------------- kinds

KINDS = ("encoder", "decoder", "encoder-decoder", "vision", "vision-text")


def kind(model_type: str, config) -> tuple[str, str]:
    """(kind, Auto class name) for a model type, from transformers' auto mappings."""
    from transformers.models.auto import modeling_auto as m

    if model_type in m.MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "vision-text", "AutoModel"
    if getattr(config, "is_encoder_decoder", False):
        seq2seq = model_type in m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
        return "encoder-decoder", "AutoModelForSeq2SeqLM" if seq2seq else "AutoModel"
    if (
        model_type in m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in m.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ):
        return "decoder", "AutoModelForCausalLM"
    if model_type in m.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "vision", "AutoModelForImageClassification"
    return "encoder", "AutoModel"
