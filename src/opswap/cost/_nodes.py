"""Small helpers that read tensors, weights and dtypes off an FX node in either graph flavour."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.fx as fx

from opswap.graph.ops import attr_tensor, module_of
from opswap.graph.shapes import TensorInfo, info, infos


def prod(xs) -> int:
    return math.prod(int(x) for x in xs)


def tinfo(value) -> TensorInfo | None:
    """TensorInfo of an FX node (from shape propagation, else its constant) or a tensor."""
    if isinstance(value, torch.Tensor):
        return TensorInfo(tuple(int(s) for s in value.shape), value.dtype)
    if isinstance(value, fx.Node):
        found = info(value)
        if found is not None:
            return found
        t = attr_tensor(value.graph.owning_module, value)
        if t is not None:
            return tinfo(t)
    return None


def _walk(value) -> Iterator[fx.Node]:
    if isinstance(value, fx.Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)


def tensor_inputs(node: fx.Node, skip: tuple[int, ...] = ()) -> list[tuple[fx.Node, TensorInfo]]:
    """Distinct tensor-valued node arguments (through lists and kwargs), in order.

    `skip` leaves out positional arguments by index (e.g. an embedding table).
    """
    seen: set[fx.Node] = set()
    out: list[tuple[fx.Node, TensorInfo]] = []
    values = [a for i, a in enumerate(node.args) if i not in skip] + list(node.kwargs.values())
    for n in _walk(values):
        if n in seen:
            continue
        seen.add(n)
        ti = tinfo(n)
        if ti is not None and n.op != "output":
            out.append((n, ti))
    return out


def module_weights(node: fx.Node) -> list[torch.Tensor]:
    """Parameters and buffers a call_module node reads (its own and its children's).

    BatchNorm's `num_batches_tracked` counter is left out: inference never reads it,
    and export graphs do not pass it, so both flavours count the same bytes.
    """
    mod = module_of(node)
    if mod is None:
        return []
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    named = [*mod.named_parameters(), *mod.named_buffers()]
    for name, t in named:
        if name.endswith("num_batches_tracked") or id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
    return out


def read_bytes(node: fx.Node, ti: TensorInfo) -> int:
    """Bytes an op reads from a tensor argument: broadcast (stride-0) dims are read once."""
    meta = node.meta.get("tensor_meta")
    stride = getattr(meta, "stride", None)
    if stride is None or len(stride) != len(ti.shape):
        return ti.nbytes
    distinct = prod(n for n, st in zip(ti.shape, stride, strict=True) if st != 0)
    return distinct * (ti.nbytes // ti.numel if ti.numel else 0)


def out_infos(node: fx.Node) -> list[TensorInfo]:
    return infos(node)


def out_info(node: fx.Node) -> TensorInfo | None:
    found = infos(node)
    return found[0] if found else None


def nbytes(ti: TensorInfo | torch.Tensor) -> int:
    if isinstance(ti, torch.Tensor):
        return ti.numel() * ti.element_size()
    return ti.nbytes


def _is_math_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype in (torch.int8, torch.uint8)


def compute_dtype(node: fx.Node) -> torch.dtype:
    """The precision an op computes in: its first floating (or int8) input, else its output."""
    for _, ti in tensor_inputs(node):
        if _is_math_dtype(ti.dtype):
            return ti.dtype
    for t in module_weights(node):
        if _is_math_dtype(t.dtype):
            return t.dtype
    o = out_info(node)
    if o is not None:
        return o.dtype
    return torch.float32


def strided_meta(node) -> torch.Tensor | None:
    """An empty meta tensor with the node's recorded shape and strides (None if unknown)."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    stride = getattr(meta, "stride", None)
    if shape is None or stride is None:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape, stride = val.shape, val.stride()
        else:
            return None
    try:
        return torch.empty_strided(tuple(shape), tuple(stride), device="meta")
    except (RuntimeError, TypeError):
        return None
