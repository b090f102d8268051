"""Turn an nn.Module into an FX graph: symbolic tracing first, torch.export second.

FX symbolic tracing keeps nn.Module leaves (nn.Conv2d stays one `call_module`
node), which is what module-swapping rules and layer-by-layer verification want.
Models with Python control flow on tensor values, in-place writes into proxies or
other untraceable code (most Hugging Face models) fall back to torch.export in
non-strict mode, which produces ATen-level nodes that still carry their
`nn_module_stack`. The capture works on a deep copy: rewriting the graph never
touches the user's module.
"""

from __future__ import annotations

import copy
import linecache
import os
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx as fx
from torch import nn

from opswap.errors import CaptureError
from opswap.graph.shapes import propagate

Method = Literal["auto", "fx", "export"]


@dataclass
class Captured:
    """A captured model: the graph module (a private copy) and how it was obtained."""

    gm: fx.GraphModule
    method: Literal["fx", "export"]
    example_inputs: tuple
    notes: list[str] = field(default_factory=list)

    def recapture_shapes(self) -> None:
        """Re-run shape propagation after the graph changed."""
        propagate(self.gm, self.example_inputs)


def quiet_deepcopy(obj):
    """A deep copy, quiet about torch's own deprecation noise (pytree's LeafSpec warns when
    the code of an exported graph is copied; nothing the user can act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        return copy.deepcopy(obj)


def copy_module(module: nn.Module) -> nn.Module:
    """A private deep copy of a module (weights included)."""
    return quiet_deepcopy(module)


def _where(exc: BaseException) -> str:
    """'file.py:LINE: source' of the deepest frame outside torch and opswap, if any."""
    torch_dir = os.path.dirname(torch.__file__)
    own_dir = os.path.dirname(os.path.dirname(__file__))
    frames = traceback.extract_tb(exc.__traceback__)
    user = [
        f
        for f in frames
        if not f.filename.startswith((torch_dir, own_dir)) and not f.filename.startswith("<")
    ]
    if not user:
        return ""
    f = user[-1]
    src = (f.line or linecache.getline(f.filename, f.lineno)).strip()
    return f"{os.path.basename(f.filename)}:{f.lineno}: `{src}`"


def _describe(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = _where(exc)
    return f"{type(exc).__name__} at {where} ({msg[:200]})" if where else f"{type(exc).__name__} ({msg[:200]})"


def as_inputs(example_inputs) -> tuple:
    """Example inputs as the tuple of forward's positional arguments."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _fx(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    propagate(gm, inputs)
    return gm


def _export(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    ep = torch.export.export(model, inputs, strict=False)
    gm = ep.module()
    propagate(gm, inputs)
    return gm


def capture(model: nn.Module, example_inputs, method: Method = "auto") -> Captured:
    """Capture `model` on `example_inputs` as an FX GraphModule with shapes on every node.

    `method="auto"` tries FX symbolic tracing and falls back to torch.export
    (non-strict). The module is deep-copied first, so the result owns its weights.
    Raises CaptureError naming the first untraceable line when neither works.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"Expected a torch.nn.Module to capture, got {type(model).__name__}.")
    inputs = as_inputs(example_inputs)
    model = copy_module(model)
    errors: list[str] = []
    notes: list[str] = []
    if model.training:
        notes.append(
            "The model is in training mode: BatchNorm folds and Dropout removal will not fire; "
            "call .eval() first to optimise for inference."
        )
    if method in ("auto", "fx"):
        try:
            return Captured(_fx(model, inputs), "fx", inputs, notes)
        except Exception as e:  # tracing raises anything from TraceError to TypeError
            errors.append(f"FX symbolic tracing failed: {_describe(e)}")
            if method == "fx":
                raise CaptureError(errors[-1] + ".") from e
            notes.append(errors[-1] + "; fell back to torch.export.")
    try:
        return Captured(_export(model, inputs), "export", inputs, notes)
    except Exception as e:
        errors.append(f"torch.export failed: {_describe(e)}")
        raise CaptureError(
            f"Could not capture {type(model).__name__}: " + "; ".join(errors)
            + ". Make that line traceable (no Python branching on tensor values) or pass a "
            "wrapper module that avoids it."
        ) from e
