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
"""

from __future__ import annotations

import os
from collections.abc import Mapping

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


def load(spec: str, overrides: Mapping[str, str] | None = None) -> LoadedModel:
    """Load the model a spec names, with overrides applied; raises SpecError on a bad spec."""
    if not isinstance(spec, str) or not spec.strip():
        raise _bad(str(spec), "it is empty")
    spec = spec.strip()
    opts = parse_overrides(overrides)
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
            return hf.load_hf_path(target, spec, opts)
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
    if spec.endswith((".pt", ".pth", ".bin", ".safetensors", ".ckpt")):
        raise _bad(spec, "a weights file holds no model code; export the model with "
                         "torch.export.save to .pt2, or build it in a file.py:function")
    if sep and not path.endswith(".py") and prefix not in ("zoo", "hf", "torchvision", "timm"):
        raise _bad(spec, f"unknown source '{prefix}'")
    raise _bad(spec, "no source prefix")
