"""Model sources: turn a spec string into an eval-mode module and example inputs.

    zoo:NAME                 built-in reference model (list_zoo())
    hf:MODEL_TYPE            Hugging Face model from a small config, random weights (list_hf_types())
    hf:PATH                  local Hugging Face checkpoint directory (config.json + weights)
    torchvision:NAME         torchvision.models.get_model(NAME, weights=None)
    timm:NAME                timm.create_model(NAME, pretrained=False)
    path/to/file.py:FUNC     FUNC() returns a module or (module, example_inputs)
    path/to/model.pt2        program saved by torch.export.save

`overrides` (the CLI's `--set key=value`) adjust the builder: sizes, batch,
sequence length, image size, config fields. Values are strings parsed as
int / float / bool / None / JSON list; unknown keys are refused.

`weights` (the CLI's `--weights FILE`) is a .safetensors or torch.save state dict
copied into the built model (see models.weights); a .pt2 spec carries its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from opswap.errors import SpecError
from opswap.models._common import LoadedModel, parse_overrides, parse_value
from opswap.models.hf import list_hf_types
from opswap.models.zoo import ZooEntry, list_zoo

__all__ = ["LoadedModel", "ZooEntry", "list_hf_types", "list_zoo", "load", "parse_value"]

FORMS = (
    "zoo:NAME, hf:MODEL_TYPE, hf:PATH, torchvision:NAME, timm:NAME, "
    "path/to/file.py:function or path/to/model.pt2"
)


def _bad(spec: str, why: str) -> SpecError:
    return SpecError(f"Cannot read model spec '{spec}' ({why}); use one of {FORMS}.")


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "~", "/")) or "/" in text or os.sep in text


def load(
    spec: str, overrides: Mapping[str, str] | None = None, weights: str | os.PathLike | None = None
) -> LoadedModel:
    """Load the model a spec names, with overrides applied and, when given, the tensors of
    a weights file copied in; raises SpecError on a bad spec or a file that does not fit."""
    if not isinstance(spec, str) or not spec.strip():
        raise _bad(str(spec), "it is empty")
    spec = spec.strip()
    opts = parse_overrides(overrides)
    if weights is None:
        return _build(spec, opts)
    path = os.path.expanduser(os.fspath(weights))
    if spec.endswith(".pt2"):
        raise SpecError(
            f"{spec} is a saved program that carries its own weights; drop "
            f"--weights {path}, or give a spec that builds the architecture."
        )
    from opswap.models.weights import read_state_dict

    tensors = read_state_dict(path)  # a missing or unsafe file fails before the build
    return with_weights(_build(spec, opts), path, tensors)


def with_weights(loaded: LoadedModel, path: str, tensors: dict | None = None) -> LoadedModel:
    """`loaded` with the tensors of `path` (read already, or now) copied into its module;
    settings and description record the file."""
    from opswap.models.weights import load_weights, read_state_dict

    if tensors is None:
        tensors = read_state_dict(path)

    sizes = dict(loaded.settings)
    config: Any = getattr(loaded.module, "config", None)
    if hasattr(config, "to_dict"):
        sizes.update({k: v for k, v in config.to_dict().items() if k not in sizes})
    record = load_weights(loaded.module, tensors, path, loaded.spec, sizes)
    loaded.settings["weights"] = record
    base = loaded.description.removesuffix(", random weights")
    keys = f", keys read with {record['keys']}" if record["keys"] != "as saved" else ""
    loaded.description = f"{base}, weights from {os.path.basename(path)}{keys}"
    return loaded


def _build(spec: str, opts: dict) -> LoadedModel:
    prefix, sep, rest = spec.partition(":")

    if sep and prefix in ("zoo", "hf", "torchvision", "timm") and not rest:
        raise _bad(spec, f"nothing follows '{prefix}:'")
    if prefix == "zoo" and sep:
        from opswap.models.zoo import load_zoo

        return load_zoo(rest, spec, opts)
    if prefix == "hf" and sep:
        from opswap.models import hf

        target = os.path.expanduser(rest)
        if os.path.isdir(target):
            from opswap.models.hf_path import load_hf_path

            return load_hf_path(target, spec, opts)
        if _looks_like_path(rest):
            raise SpecError(
                f"hf:{rest} is neither a local checkpoint directory nor a model type; opswap does "
                f"not download from the Hub: save the model with save_pretrained and give its directory."
            )
        return hf.load_hf_type(rest, spec, opts)
    if prefix in ("torchvision", "timm") and sep:
        from opswap.models import vision

        loader = vision.load_torchvision if prefix == "torchvision" else vision.load_timm
        return loader(rest, spec, opts)

    path, sep, function = spec.rpartition(":")
    if sep and path.endswith(".py"):
        from opswap.models.file import load_file

        if not function:
            raise _bad(spec, "no function after the ':'")
        return load_file(os.path.expanduser(path), function, spec, opts)
    if spec.endswith(".py"):
        raise _bad(spec, "a .py file needs the function that builds the model: file.py:function")
    if spec.endswith(".pt2"):
        from opswap.models.checkpoint import load_checkpoint

        return load_checkpoint(os.path.expanduser(spec), spec, opts)
    if spec.lower().endswith(".onnx"):
        raise SpecError(
            f"{spec} is an ONNX file, which `opswap analyze`, `plan` and `optimize` read "
            "(opswap.onnx.load_onnx in Python); this command takes a PyTorch model."
        )
    if spec.endswith((".pt", ".pth", ".bin", ".safetensors", ".ckpt")):
        raise _bad(
            spec,
            "a weights file holds no model code; export the model with "
            "torch.export.save to .pt2, or build it in a file.py:function",
        )
    if sep and not path.endswith(".py") and prefix not in ("zoo", "hf", "torchvision", "timm"):
        raise _bad(spec, f"unknown source '{prefix}'")
    raise _bad(spec, "no source prefix")
