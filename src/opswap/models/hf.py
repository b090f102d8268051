"""Hugging Face models: `hf:MODEL_TYPE` from a small config with random weights, `hf:PATH` from disk.

The model is wrapped in `HFModule`, whose forward takes the main input
positionally and returns the model output as a plain tuple of tensors
(`return_dict=False` on the outer call only: setting it in the config breaks the
task heads of transformers 5, which read attributes of their inner model's
output). The Hugging Face model itself sits at `.model`, so submodule names read
`model.encoder.layer.0.attention...`.

Attention defaults to `attn_implementation="eager"`, so the captured graph shows
the matmul-softmax-matmul that attention rules replace; `--set
attn_implementation=sdpa` gives the fused path. Causal LMs are built with
`use_cache=False`, so no cache object is returned. transformers is optional.
"""

from __future__ import annotations

import importlib
import os
import pickle
from typing import Any

import torch
from torch import nn

from opswap.errors import SpecError
from opswap.models._common import LoadedModel, coerce, seeded

_INSTALL = "pip install 'opswap[hf]'"

# Small sizes shared by the text models: 2 layers, hidden 64, 4 heads, vocab 1000.
_TEXT = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=128)
_DECODER = dict(_TEXT, num_key_value_heads=2, use_cache=False, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)

# model_type -> (Auto class name, small config overrides, one-line description).
_TYPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "bert": ("AutoModel", dict(_TEXT), "BERT encoder (with pooler)"),
    "roberta": ("AutoModel", dict(_TEXT, pad_token_id=1), "RoBERTa encoder (with pooler)"),
    "distilbert": ("AutoModel", dict(vocab_size=1000, dim=64, n_layers=2, n_heads=4,
                                     hidden_dim=128, max_position_embeddings=128),
                   "DistilBERT encoder"),
    "gpt2": ("AutoModelForCausalLM", dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=4,
                                          n_positions=128, use_cache=False, bos_token_id=1,
                                          eos_token_id=2),
             "GPT-2 decoder with LM head"),
    "llama": ("AutoModelForCausalLM", dict(_DECODER), "LLaMA decoder with LM head (GQA 4:2)"),
    "mistral": ("AutoModelForCausalLM", dict(_DECODER), "Mistral decoder with LM head"),
    "qwen2": ("AutoModelForCausalLM", dict(_DECODER), "Qwen2 decoder with LM head"),
    "vit": ("AutoModelForImageClassification",
            dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=128, num_labels=10),
            "ViT image classifier"),
    "resnet": ("AutoModelForImageClassification",
               dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                    layer_type="basic", num_labels=10),
               "ResNet image classifier (basic blocks)"),
    "mobilenet_v2": ("AutoModelForImageClassification",
                     dict(image_size=32, depth_multiplier=0.35, num_labels=10),
                     "MobileNetV2 image classifier"),
    "convnext": ("AutoModelForImageClassification",
                 dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=32,
                      num_labels=10),
                 "ConvNeXt image classifier"),
}

# Overrides that are not config fields.
_INPUT_KEYS = ("batch", "seq", "image_size", "attn_implementation", "seed")
_DEFAULT_BATCH, _DEFAULT_SEQ, _DEFAULT_IMAGE = 2, 32, 32


def list_hf_types() -> list[str]:
    """The model types `hf:MODEL_TYPE` builds from a config."""
    return list(_TYPES)


def _transformers():
    try:
        return importlib.import_module("transformers")
    except Exception as e:  # a broken install raises more than ImportError
        raise SpecError(
            f"hf: models need transformers, which could not be imported ({type(e).__name__}: "
            f"{e}); install it with {_INSTALL}."
        ) from e


class HFModule(nn.Module):
    """A Hugging Face model called on its main input (input_ids or pixel_values), returning a tuple."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.config

    def forward(self, main_input: torch.Tensor):
        # One named argument rather than *args, so FX tracing reaches the model itself.
        return self.model(main_input, return_dict=False)


def _example_inputs(model: nn.Module, config, batch: int, seq: int, image_size: int) -> tuple:
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        vocab = getattr(config, "vocab_size", None)
        if not vocab:
            raise SpecError(f"{type(model).__name__} takes input_ids but its config has no vocab_size.")
        return (torch.randint(0, vocab, (batch, seq), dtype=torch.int64),)
    if name == "pixel_values":
        channels = getattr(config, "num_channels", 3)
        return (torch.randn(batch, channels, image_size, image_size),)
    raise SpecError(
        f"{type(model).__name__} takes '{name}', which opswap cannot make example inputs for; "
        f"load it through a file.py:function spec that returns (model, inputs)."
    )


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
            examples = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "vocab_size", "num_labels") if k in fields]
            raise SpecError(
                f"Unknown override '{key}' for {where}; accepted keys: "
                f"{', '.join(_INPUT_KEYS)}, or any {type(config).__name__} field"
                + (f" (e.g. {', '.join(examples)})." if examples else ".")
            )


def _shape_settings(inputs: dict[str, Any], where: str) -> tuple[int, int, int, str, int]:
    batch = coerce("batch", inputs.get("batch", _DEFAULT_BATCH), 1, where)
    seq = coerce("seq", inputs.get("seq", _DEFAULT_SEQ), 1, where)
    image = coerce("image_size", inputs.get("image_size", _DEFAULT_IMAGE), 1, where)
    attn = str(inputs.get("attn_implementation", "eager"))
    seed = coerce("seed", inputs.get("seed", 0), 1, where)
    for key, v in (("batch", batch), ("seq", seq), ("image_size", image)):
        if v < 1:
            raise SpecError(f"Override {key} for {where} must be at least 1, got {v}.")
    return batch, seq, image, attn, seed


def load_hf_type(model_type: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """Build `hf:MODEL_TYPE` from a small config with seeded random weights."""
    if model_type not in _TYPES:
        raise SpecError(
            f"Unknown Hugging Face model type '{model_type}'; supported: {', '.join(_TYPES)} "
            f"(or give hf:PATH to a local checkpoint directory)."
        )
    tf = _transformers()
    where = f"hf:{model_type}"
    auto_name, small, description = _TYPES[model_type]
    inputs, config_overrides = _split(overrides)
    batch, seq, image, attn, seed = _shape_settings(inputs, where)
    if "image_size" in inputs and "image_size" in small:
        config_overrides.setdefault("image_size", image)
    config = tf.AutoConfig.for_model(model_type, **small)
    _check_config_keys(config_overrides, config, where)
    for key, value in config_overrides.items():
        setattr(config, key, coerce(key, value, getattr(config, key, None), where))
    _check_lengths(config, seq, where)
    auto = getattr(tf, auto_name)
    with seeded(seed):
        try:
            model = auto.from_config(config, attn_implementation=attn)
        except (ValueError, TypeError) as e:
            raise SpecError(f"transformers could not build {where} with these settings: {e}") from e
        wrapped = HFModule(model).eval()
        example = _example_inputs(model, config, batch, seq, image)
    settings = dict(config_overrides, batch=batch, seq=seq, image_size=image,
                    attn_implementation=attn, seed=seed)
    return LoadedModel(name=model_type, spec=spec, source="hf", module=wrapped,
                       example_inputs=example, description=f"{description}, random weights",
                       settings=settings)


def _check_lengths(config, seq: int, where: str) -> None:
    for field in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, field, None)
        if isinstance(limit, int) and seq > limit:
            raise SpecError(f"Override seq for {where} is {seq} but {field} is {limit}; raise {field} too.")


def load_hf_path(path: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """Load a local checkpoint directory saved with save_pretrained.

    Safetensors weights are used when present; a pytorch_model.bin is read by
    transformers with torch.load(weights_only=True), so no pickled code runs.
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SpecError(f"{path} is not a Hugging Face checkpoint directory: it has no config.json.")
    files = os.listdir(path)
    has_safetensors = any(f.endswith(".safetensors") for f in files)
    has_bin = any(f.endswith(".bin") for f in files)
    if not has_safetensors and not has_bin:
        raise SpecError(f"{path} has a config.json but no weights (*.safetensors or *.bin).")
    tf = _transformers()
    where = spec
    inputs, config_overrides = _split(overrides)
    batch, seq, image, attn, seed = _shape_settings(inputs, where)
    config = tf.AutoConfig.from_pretrained(path)
    _check_config_keys(config_overrides, config, where)
    for key, value in config_overrides.items():
        setattr(config, key, coerce(key, value, getattr(config, key, None), where))
    _check_lengths(config, seq, where)
    if "image_size" not in inputs and isinstance(getattr(config, "image_size", None), int):
        image = config.image_size
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(tf, arch, None) if arch else None
    cls = cls or tf.AutoModel
    try:
        model = cls.from_pretrained(path, config=config, attn_implementation=attn,
                                    use_safetensors=has_safetensors, weights_only=True)
    except pickle.UnpicklingError as e:
        raise SpecError(
            f"{path} holds a .bin file with pickled objects other than tensors, which opswap "
            f"refuses to load; convert it to safetensors with code you trust."
        ) from e
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(f"Could not load the checkpoint in {path}: {first}") from e
    wrapped = HFModule(model).eval()
    with seeded(seed):
        example = _example_inputs(model, config, batch, seq, image)
    name = os.path.basename(os.path.normpath(path))
    settings = dict(config_overrides, batch=batch, seq=seq, image_size=image,
                    attn_implementation=attn, seed=seed)
    return LoadedModel(name=name, spec=spec, source="hf", module=wrapped, example_inputs=example,
                       description=f"{type(model).__name__} loaded from {path}", settings=settings)
