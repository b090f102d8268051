"""What a tuning record is keyed by: a site's op signature and shapes, the device, the versions.

The op signature is the matched nodes' op kinds and settings with every tensor written
as its dtype and rank (`conv(T0:float32:4d,T1:float32:4d,None,(1, 1),(1, 1),(1, 1),1)`),
so that one signature covers every size of that op; the sizes are the key's `shapes`,
which near keys compare. Node names never enter a key: the same layer in another model
is the same record.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from opswap._version import __version__
from opswap.graph.ops import op_kind
from opswap.graph.shapes import info
from opswap.tuning.db import Shapes


@functools.cache
def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(kind: str) -> str:
    """The chip a measurement ran on: the CPU's model and torch's thread count (a time on
    two threads is not one on sixteen), or the current GPU's name."""
    if kind == "cuda" and torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name()}"
    return f"cpu: {cpu_name()}, {torch.get_num_threads()} threads"


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def _driver(kind: str) -> str:
    if kind != "cuda" or not torch.cuda.is_available():
        return "none"
    try:
        return str(getattr(torch._C, "_cuda_getDriverVersion")())  # noqa: B009
    except (AttributeError, RuntimeError):
        return f"cuda {torch.version.cuda}"


def versions(kind: str) -> str:
    """The software a measurement depends on, one string: an upgrade of any is a miss."""
    return (
        f"torch {torch.__version__}; triton {_package_version('triton')}; "
        f"driver {_driver(kind)}; opswap {__version__}"
    )


@dataclass(frozen=True)
class Signature:
    """A site's op signature without sizes, its tensors' sizes, dtype and layout."""

    op: str
    shapes: Shapes
    dtype: str
    layout: str


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _layout(node: fx.Node) -> str | None:
    """channels_last for a 4-D tensor stored so, contiguous for another, None unknown."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        if val.dim() == 4 and not val.is_contiguous():
            if val.is_contiguous(memory_format=torch.channels_last):
                return "channels_last"
        return "contiguous"
    tm = node.meta.get("tensor_meta")
    fmt = getattr(tm, "memory_format", None)
    if fmt is torch.channels_last:
        return "channels_last"
    return "contiguous" if tm is not None else None


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def signature(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> Signature:
    """The signature of the site made of `nodes` (a rule's match) in `gm`."""
    inside = {n: i for i, n in enumerate(nodes)}
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    layouts: list[str] = []

    def tensor(t: torch.Tensor | Any, node: fx.Node | None) -> str:
        shapes.append(tuple(int(s) for s in t.shape))
        dtypes.append(_dtype(t.dtype))
        lay = _layout(node) if node is not None else None
        if lay is not None:
            layouts.append(lay)
        return f"T{len(shapes) - 1}:{dtypes[-1]}:{len(shapes[-1])}d"

    def term(a: Any) -> str:
        if isinstance(a, fx.Node):
            if a in inside:
                return f"%{inside[a]}"
            if a.op == "get_attr":
                value = _attr(gm, str(a.target))
                if isinstance(value, torch.Tensor):
                    return tensor(value, None)
            meta = info(a)
            return tensor(meta, a) if meta is not None else "?"
        if isinstance(a, (list, tuple)):
            inner = ",".join(term(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}={term(v)}" for k, v in sorted(a.items())) + "}"
        if isinstance(a, torch.dtype):
            return _dtype(a)
        return repr(a)

    parts = []
    for node in nodes:
        head = op_kind(node)
        if node.op == "call_module":
            mod = _attr(gm, str(node.target))
            head += f"[{type(mod).__name__}({mod.extra_repr() if mod is not None else ''})]"
            if isinstance(mod, torch.nn.Module):
                head += "".join(
                    f"{{{name}={tensor(p, None)}}}" for name, p in mod.named_parameters()
                )
        args = ",".join(term(a) for a in node.args)
        kwargs = ",".join(f"{k}={term(v)}" for k, v in sorted(node.kwargs.items()))
        parts.append(f"{head}({args}{';' + kwargs if kwargs else ''})")
    return Signature(
        " > ".join(parts),
        tuple(shapes),
        dtypes[0] if dtypes else "none",
        "channels_last" if "channels_last" in layouts else "contiguous",
    )
