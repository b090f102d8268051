"""Hugging Face models: `hf:MODEL_TYPE` from a config with random weights, `hf:PATH` from disk.

`hf:MODEL_TYPE` builds any model type transformers can build from a config. It
starts from `AutoConfig.for_model(MODEL_TYPE)`'s defaults and shrinks them by the
config's own fields (models.hf_small): 2 layers, hidden 64 in 4 heads, vocabulary
1000, 32-pixel images, sub-configs (CLIP's text and vision towers) alike; `--set
size=full` keeps the full default config. The types in `_PRESETS` have hand-tuned
small configs instead; `list_hf_types()` names the presets and the generic types
that opswap has checked end to end (`opswap optimize` runs and verifies on them),
and `hf_kinds()` says which kind each is. Any other type is tried the same way;
one that cannot be built or called is refused in one sentence (a missing package,
an input such as audio features that opswap cannot make).

The Auto class follows the kind, read from transformers' auto mappings: causal
LMs (AutoModelForCausalLM) for decoders, seq2seq LMs for encoder-decoders (t5,
bart), image classifiers for vision models, AutoModel for encoders (with pooler)
and vision-text models (clip, siglip).

The model is wrapped in `HFModule`, whose forward takes the inputs positionally in
a fixed order recorded in `input_names` (models.hf_inputs: input_ids,
attention_mask, token_type_ids for bert; input_ids, attention_mask,
decoder_input_ids for t5; input_ids, pixel_values, attention_mask for clip),
calls the model with keywords and returns its output as a plain tuple of tensors
(`return_dict=False` on the outer call only: setting it in the config breaks the
task heads of transformers 5, which read attributes of their inner model's
output). The attention mask is right-padded, some rows shorter than others, so
verification runs through real padding; `--set mask=none` leaves it out. The
Hugging Face model itself sits at `.model`, so submodule names read
`model.encoder.layer.0.attention...`.

Attention defaults to `attn_implementation="eager"`, so the captured graph shows
the matmul-softmax-matmul that attention rules replace; `--set
attn_implementation=sdpa` gives the fused path. Decoders and encoder-decoders are
built with `use_cache=False`, so no cache object is returned; `hf:PATH` checkpoints
load the same way (models.hf_path). transformers is optional.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.errors import SpecError
from opswap.models import hf_small
from opswap.models._common import LoadedModel, coerce, seeded
from opswap.models.hf_inputs import ALL_INPUTS as _INPUT_NAMES
from opswap.models.hf_inputs import input_names, make_inputs

_INSTALL = "pip install 'opswap[hf]'"

# Small sizes shared by the text presets: 2 layers, hidden 64, 4 heads, vocab 1000.
_TEXT = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=128,
)
_DECODER = dict(
    _TEXT, num_key_value_heads=2, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0
)

# model_type -> (kind, Auto class name, small config, one-line description): hand-tuned
# small configs, kept as they were before the generic path existed.
_PRESETS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "bert": ("encoder", "AutoModel", dict(_TEXT), "BERT encoder (with pooler)"),
    "roberta": (
        "encoder",
        "AutoModel",
        dict(_TEXT, pad_token_id=1),
        "RoBERTa encoder (with pooler)",
    ),
    "distilbert": (
        "encoder",
        "AutoModel",
        dict(
            vocab_size=1000,
            dim=64,
            n_layers=2,
            n_heads=4,
            hidden_dim=128,
            max_position_embeddings=128,
        ),
        "DistilBERT encoder",
    ),
    "gpt2": (
        "decoder",
        "AutoModelForCausalLM",
        dict(
            vocab_size=1000,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            use_cache=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "GPT-2 decoder with LM head",
    ),
    "llama": (
        "decoder",
        "AutoModelForCausalLM",
        dict(_DECODER),
        "LLaMA decoder with LM head (GQA 4:2)",
    ),
    "mistral": ("decoder", "AutoModelForCausalLM", dict(_DECODER), "Mistral decoder with LM head"),
    "qwen2": ("decoder", "AutoModelForCausalLM", dict(_DECODER), "Qwen2 decoder with LM head"),
    "vit": (
        "vision",
        "AutoModelForImageClassification",
        dict(
            image_size=32,
            patch_size=8,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            num_labels=10,
        ),
        "ViT image classifier",
    ),
    "resnet": (
        "vision",
        "AutoModelForImageClassification",
        dict(
            embedding_size=16,
            hidden_sizes=[16, 32, 64, 128],
            depths=[1, 1, 1, 1],
            layer_type="basic",
            num_labels=10,
        ),
        "ResNet image classifier (basic blocks)",
    ),
    "mobilenet_v2": (
        "vision",
        "AutoModelForImageClassification",
        dict(image_size=32, depth_multiplier=0.35, num_labels=10),
        "MobileNetV2 image classifier",
    ),
    "convnext": (
        "vision",
        "AutoModelForImageClassification",
        dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=32, num_labels=10),
        "ConvNeXt image classifier",
    ),
}

# Types the generic path builds that `opswap optimize hf:TYPE --target cpu` was run on
# and verified (see docs/models.md for the runs), with their kind.
_CHECKED: dict[str, str] = {
    **dict.fromkeys(
        ("albert", "electra", "deberta-v2", "deberta", "mpnet", "xlm-roberta", "roformer"),
        "encoder",
    ),
    **dict.fromkeys(
        (
            "phi",
            "phi3",
            "gemma",
            "gemma2",
            "qwen3",
            "opt",
            "gpt_neox",
            "falcon",
            "bloom",
            "gptj",
            "codegen",
            "stablelm",
            "olmo",
            "granite",
            "starcoder2",
            "mixtral",
        ),
        "decoder",
    ),
    **dict.fromkeys(
        ("t5", "mt5", "bart", "mbart", "marian", "pegasus", "m2m_100", "blenderbot-small"),
        "encoder-decoder",
    ),
    **dict.fromkeys(
        (
            "swin",
            "swinv2",
            "deit",
            "beit",
            "dinov2",
            "convnextv2",
            "mobilenet_v1",
            "regnet",
            "levit",
            "segformer",
            "poolformer",
        ),
        "vision",
    ),
    **dict.fromkeys(("clip", "siglip", "chinese_clip", "altclip"), "vision-text"),
}

# The Auto classes opswap picks, and the transformers mapping each one reads.
_MAPPINGS = {
    "AutoModel": "MODEL_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForSeq2SeqLM": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForImageClassification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}

# Overrides that are not config fields.
_INPUT_KEYS = ("batch", "seq", "image_size", "attn_implementation", "seed", "mask", "size")
_DEFAULT_BATCH, _DEFAULT_SEQ, _DEFAULT_IMAGE = 2, 32, 32
_NUM_LABELS = 10  # vision classifiers get 10 classes, like the presets


def list_hf_types() -> list[str]:
    """The model types `hf:MODEL_TYPE` has been checked on: the presets, then the generic ones."""
    return list(_PRESETS) + [t for t in _CHECKED if t not in _PRESETS]


def list_hf_presets() -> list[str]:
    """The types with a tuned small config (a subset of list_hf_types())."""
    return list(_PRESETS)


def hf_kinds() -> dict[str, str]:
    """Kind of each checked type: encoder, decoder, encoder-decoder, vision or vision-text."""
    return {t: _PRESETS[t][0] if t in _PRESETS else _CHECKED[t] for t in list_hf_types()}


def _transformers():
    try:
        return importlib.import_module("transformers")
    except Exception as e:  # a broken install raises more than ImportError
        raise SpecError(
            f"hf: models need transformers, which could not be imported ({type(e).__name__}: "
            f"{e}); install it with {_INSTALL}."
        ) from e


class HFModule(nn.Module):
    """A Hugging Face model called on its inputs, given positionally in the order of
    `input_names` and passed on by keyword; returns the model output as a flat tuple.

    forward has one named parameter per input (`forward(self, input_ids,
    attention_mask)`), not `*inputs`: FX then traces into the model itself and
    torch.export takes one dynamic-shape entry per input. Each order of names gets its
    own subclass, made once."""

    def __new__(cls, model: nn.Module | None = None, input_names: tuple[str, ...] = ("input_ids",)):
        if cls is HFModule:
            cls = _module_class(tuple(input_names))
        return super().__new__(cls)

    def __init__(self, model: nn.Module, input_names: tuple[str, ...] = ("input_ids",)):
        super().__init__()
        self.model = model
        self.input_names = tuple(input_names)

    @property
    def config(self):
        return self.model.config

    def name_outputs(self, example: tuple) -> tuple[str, ...] | None:
        """Run the model once on `example` and name each output of the flat tuple forward
        returns from the model's own output fields (`logits`, `last_hidden_state`; a
        field holding several tensors gives `NAME_0`, `NAME_1`, ...), kept as
        `opswap_output_names`, which exports carry into their files' output names. None
        (and nothing kept) where the names do not pair one to one with forward's outputs."""
        kw = dict(zip(self.input_names, example, strict=True))
        with torch.no_grad():
            flat = self(*example)
            fields = self.model(**kw, return_dict=True)
        names: list[str] = []
        shapes: list[tuple[int, ...]] = []
        for key, value in fields.items() if hasattr(fields, "items") else ():
            leaves = [x for x in pytree.tree_leaves(value) if x is not None]
            for i, leaf in enumerate(leaves):
                names.append(key if len(leaves) == 1 else f"{key}_{i}")
                shapes.append(tuple(getattr(leaf, "shape", ())))
        if len(names) != len(flat) or shapes != [tuple(getattr(x, "shape", ())) for x in flat]:
            return None
        self.opswap_output_names = tuple(names)
        return self.opswap_output_names


_CLASSES: dict[tuple[str, ...], type] = {}


def _flat(out) -> tuple:
    """The model's output tuple with nested tuples flattened (clip returns its towers'
    outputs as tuples inside the tuple) and Nones dropped."""
    return tuple(x for x in pytree.tree_leaves(out) if x is not None)


def _module_class(names: tuple[str, ...]) -> type:
    """The HFModule subclass whose forward takes `names` in that order."""
    if names not in _CLASSES:
        if not names or not all(n.isidentifier() and n in _INPUT_NAMES for n in names):
            raise ValueError(
                f"HFModule inputs must be some of {', '.join(_INPUT_NAMES)}, got {names}."
            )
        params = ", ".join(names)
        call = ", ".join(f"{n}={n}" for n in names)
        scope: dict[str, Any] = {}
        # A generated def (as dataclasses and namedtuple do) is what gives forward real
        # parameter names; the names come from the fixed set above.
        exec(
            f"def forward(self, {params}):\n"
            f"    return _flat(self.model({call}, return_dict=False))\n",
            {"_flat": _flat},
            scope,
        )
        _CLASSES[names] = type(
            "HFModule", (HFModule,), {"forward": scope["forward"], "__module__": __name__}
        )
    return _CLASSES[names]


def _first_line(e: BaseException) -> str:
    """The exception's type and first sentence, for quoting inside a sentence of ours."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    first = text.splitlines()[0]
    if ". " in first:  # transformers' ImportErrors go on with install hints
        first = first[: first.index(". ")]
    return f"{type(e).__name__}: {first.rstrip('.:')[:200]}"


def _split(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    inputs = {k: overrides[k] for k in _INPUT_KEYS if k in overrides}
    config = {k: v for k, v in overrides.items() if k not in _INPUT_KEYS}
    return inputs, config


def _check_config_keys(config_overrides: dict[str, Any], config, where: str) -> None:
    # Only real fields (and their aliases, e.g. gpt2's hidden_size -> n_embd): a name
    # like `to_dict` is an attribute too, and must not be overwritten.
    fields = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    for key in config_overrides:
        if key not in fields:
            examples = [
                k
                for k in (
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "vocab_size",
                    "num_labels",
                )
                if k in fields
            ]
            raise SpecError(
                f"Unknown override '{key}' for {where}; accepted keys: "
                f"{', '.join(_INPUT_KEYS)}, or any {type(config).__name__} field"
                + (f" (e.g. {', '.join(examples)})." if examples else ".")
            )


def _shape_settings(inputs: dict[str, Any], where: str) -> tuple[int, int, int, str, int, bool]:
    batch = coerce("batch", inputs.get("batch", _DEFAULT_BATCH), 1, where)
    seq = coerce("seq", inputs.get("seq", _DEFAULT_SEQ), 1, where)
    image = coerce("image_size", inputs.get("image_size", _DEFAULT_IMAGE), 1, where)
    attn = str(inputs.get("attn_implementation", "eager"))
    seed = coerce("seed", inputs.get("seed", 0), 1, where)
    for key, v in (("batch", batch), ("seq", seq), ("image_size", image)):
        if v < 1:
            raise SpecError(f"Override {key} for {where} must be at least 1, got {v}.")
    mask = inputs.get("mask", "padded")
    if mask not in ("padded", "none", None, True, False):
        raise SpecError(f"Override mask for {where} must be padded or none, got {mask!r}.")
    return batch, seq, image, attn, seed, mask in ("padded", True)


def _size(inputs: dict[str, Any], where: str) -> str:
    size = inputs.get("size", "small")
    if size not in ("small", "full"):
        raise SpecError(f"Override size for {where} must be small or full, got {size!r}.")
    return size


def _plan(tf, model_type: str, where: str) -> tuple[str, str, dict[str, Any], str]:
    """(kind, Auto class name, small config, description) for a model type."""
    if model_type in _PRESETS:
        return _PRESETS[model_type]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise SpecError(
            f"Unknown Hugging Face model type '{model_type}' (transformers {tf.__version__} "
            f"has no such type; {hint}opswap has checked {', '.join(list_hf_types())}; or give "
            f"hf:PATH to a local checkpoint directory)."
        )
    try:
        default = tf.AutoConfig.for_model(model_type)
    except Exception as e:
        raise SpecError(
            f"transformers could not make a default config for {where} ({_first_line(e)})."
        ) from e
    kind, auto = hf_small.kind(model_type, default)
    small = hf_small.shrink(default)
    fields = set(default.to_dict())
    if kind in ("decoder", "encoder-decoder") and "use_cache" in fields:
        small["use_cache"] = False
    if kind == "vision":
        small["num_labels"] = _NUM_LABELS
    return kind, auto, small, f"{kind} {model_type}"


def _merge(small: dict[str, Any], overrides: dict[str, Any], config) -> dict[str, Any]:
    """The small config with the user's overrides: aliases resolved to the field they
    name, a sub-config given as a mapping merged into the small one."""
    amap = getattr(config, "attribute_map", {}) or {}
    out = dict(small)
    for key, value in overrides.items():
        key = amap.get(key, key)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = {**out[key], **value}
        out[key] = value
    return out


def _build_config(
    tf, model_type: str, config_overrides: dict[str, Any], size: str, image: int | None, where: str
):
    """(config, kind, Auto class name, description) that `hf:model_type` builds."""
    kind, auto, small, description = _plan(tf, model_type, where)
    if size == "full":
        small = {k: v for k, v in small.items() if k in ("use_cache", "num_labels")}
    if image is not None and "image_size" in small:
        config_overrides.setdefault("image_size", image)
    try:
        config = tf.AutoConfig.for_model(model_type, **small)
    except Exception as e:
        raise SpecError(
            f"transformers refused the small config opswap made for {where} "
            f"({_first_line(e)}); try --set size=full."
        ) from e
    _check_config_keys(config_overrides, config, where)
    coerced = {
        k: coerce(k, v, getattr(config, k, None), where) for k, v in config_overrides.items()
    }
    if coerced:
        try:
            config = tf.AutoConfig.for_model(model_type, **_merge(small, coerced, config))
        except Exception as e:
            raise SpecError(
                f"transformers refused these overrides for {where} ({_first_line(e)})."
            ) from e
    if image is not None and "image_size" not in small:
        vision = getattr(config, "vision_config", None)
        for c in (config, vision):
            if c is not None and isinstance(getattr(c, "image_size", None), int):
                c.image_size = image
    return config, kind, auto, description


def hf_config(model_type: str, overrides: dict[str, Any] | None = None):
    """The transformers config `hf:model_type` builds with these overrides (`size=full`
    included), without building the model."""
    from opswap.models._common import parse_overrides

    tf = _transformers()
    where = f"hf:{model_type}"
    inputs, config_overrides = _split(parse_overrides(overrides))
    _shape_settings(inputs, where)
    image = coerce("image_size", inputs["image_size"], 1, where) if "image_size" in inputs else None
    return _build_config(tf, model_type, config_overrides, _size(inputs, where), image, where)[0]


def _model_class_hint(tf, model_type: str, auto: str, config) -> None:
    """Name the class in `config.architectures` where the Auto mapping holds several
    (deit's classifier and its distilled twin), which Auto.from_config cannot choose from."""
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, _MAPPINGS[auto]).get(model_type)
    if isinstance(names, (tuple, list)) and not getattr(config, "architectures", None):
        config.architectures = [names[0]]


def _image_size(config, inputs: dict[str, Any], default: int) -> int:
    if "image_size" in inputs:
        return default
    for c in (getattr(config, "vision_config", None), config):
        if c is not None and isinstance(getattr(c, "image_size", None), int):
            return c.image_size
    return default


def load_hf_type(model_type: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """Build `hf:MODEL_TYPE` from a small (or, with size=full, the default) config with
    seeded random weights."""
    tf = _transformers()
    where = f"hf:{model_type}"
    inputs, config_overrides = _split(overrides)
    batch, seq, image, attn, seed, mask = _shape_settings(inputs, where)
    size = _size(inputs, where)
    config, kind, auto_name, description = _build_config(
        tf, model_type, config_overrides, size, image if "image_size" in inputs else None, where
    )
    _check_lengths(config, seq, where)
    image = _image_size(config, inputs, image)
    _model_class_hint(tf, model_type, auto_name, config)
    auto = getattr(tf, auto_name)
    with seeded(seed):
        try:
            model = auto.from_config(config, attn_implementation=attn)
        except ImportError as e:
            raise SpecError(
                f"{where} needs a package that is not installed ({_first_line(e)})."
            ) from e
        except Exception as e:
            raise SpecError(
                f"transformers could not build {where} with these settings ({_first_line(e)})."
            ) from e
        if kind == "encoder" and getattr(model, "main_input_name", "") == "pixel_values":
            kind = "vision"
        names = input_names(model, kind, mask, where)
        wrapped = HFModule(model, names).eval()
        example = make_inputs(names, config, batch, seq, image, where)
    _try_call(wrapped, example, names, where)
    if model_type not in _PRESETS:
        description = f"{type(model).__name__} ({kind}, {size} config)"
    settings = dict(
        config_overrides,
        batch=batch,
        seq=seq,
        image_size=image,
        attn_implementation=attn,
        seed=seed,
        mask="padded" if mask else "none",
        size=size,
        kind=kind,
        inputs=list(names),
    )
    return LoadedModel(
        name=model_type,
        spec=spec,
        source="hf",
        module=wrapped,
        example_inputs=example,
        description=f"{description}, random weights",
        settings=settings,
    )


def _try_call(module: HFModule, example: tuple, names: tuple[str, ...], where: str) -> None:
    """Refuse in one sentence a model that fails on the inputs opswap made for it; name
    its outputs from the same call (`HFModule.name_outputs`)."""
    try:
        module.name_outputs(example)
    except Exception as e:
        raise SpecError(
            f"{where} failed on the inputs opswap makes for it ({', '.join(names)}): "
            f"{_first_line(e)}; load it through a file.py:function spec that "
            "returns (model, inputs)."
        ) from e


def _check_lengths(config, seq: int, where: str) -> None:
    for c in (config, getattr(config, "text_config", None)):
        for field in ("max_position_embeddings", "n_positions"):
            limit = getattr(c, field, None) if c is not None else None
            if isinstance(limit, int) and 0 < limit < seq:  # xlnet's -1 means no limit
                raise SpecError(
                    f"Override seq for {where} is {seq} but {field} is {limit}; raise {field} too."
                )
