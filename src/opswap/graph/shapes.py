"""Shape and dtype of every node, from real runs of the captured graph.

Both capture paths run `ShapeProp`, so every node carries
`node.meta["tensor_meta"]` (at the example inputs) in the same form; `info(node)`
reads it. With probes (the inputs at another batch size or sequence length, see
`graph.dynamic`) the graph is also run at those, and `node.meta["probe_meta"]`
keeps what each probe saw: `dynamic_dims(node)` says which sizes move with the
input, and `metas(node)` lets a rule check a property at every shape, not only at
the example's.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{','.join(map(str, self.shape))}]"


def _itemsize(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 1
    return torch.empty((), dtype=dtype).element_size()


def propagate(gm: fx.GraphModule, example_inputs: tuple, probes=()) -> list[Exception | None]:
    """Annotate every node of gm with shapes, strides and dtypes by running it (no grad)
    at each probe and then at the example; buffers are put back afterwards.

    Returns, per probe, None or the exception the graph's op raised there (that probe then
    contributes nothing to `metas`). The example run must succeed: its error propagates.
    Nothing is printed for a failing run: torch's ShapeProp would print its traceback.
    """
    from opswap.graph.copies import preserved_state
    from opswap.graph.inputs import fresh

    seen: dict[fx.Node, list] = {n: [] for n in gm.graph.nodes}
    errors: list[Exception | None] = []
    with torch.no_grad(), preserved_state(gm):
        for probe in probes:
            for n in gm.graph.nodes:
                n.meta.pop("tensor_meta", None)
            try:
                _shape_prop(gm, fresh(probe), ranges=False)
                errors.append(None)
            except Exception as e:  # the caller decides what a graph that fails here means
                errors.append(e)
            for n in gm.graph.nodes:
                tm = n.meta.pop("tensor_meta", None)
                if errors[-1] is None:
                    seen[n].append(tm)
        _shape_prop(gm, fresh(example_inputs))
    for n in gm.graph.nodes:
        n.meta["probe_meta"] = seen.get(n, [])
    return errors


_PRINTED = "Traceback (most recent call last):"


def _shape_prop(gm: fx.GraphModule, inputs: tuple, ranges: bool = True) -> None:
    """ShapeProp on `inputs`, raising the failing op's own error. torch's ShapeProp prints
    the traceback to stderr before it wraps the error in one that spells out the node and
    its meta (`traceback.print_exc()` in ShapeProp.run_node, torch 2.11-2.14), so a run
    that goes on and succeeds would show a raw traceback; what else the graph writes to
    stderr is passed on. `ranges`: each node's largest magnitude too (`_RangeProp`)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            (_RangeProp(gm) if ranges else ShapeProp(gm)).propagate(*inputs)
    except RuntimeError as e:
        text = printed.getvalue()
        sys.stderr.write(text[: text.find(_PRINTED)] if _PRINTED in text else text)
        cause = e.__cause__
        if str(e).startswith("ShapeProp error") and isinstance(cause, Exception):
            raise cause from None
        raise
    except BaseException:
        sys.stderr.write(printed.getvalue())
        raise
    sys.stderr.write(printed.getvalue())


class _RangeProp(ShapeProp):
    """ShapeProp that also keeps each floating-point output's largest magnitude as
    `node.meta["amax"]` (run at the example only), for rules whose safety depends on the
    values' range (float16's 65504). One min/max pass, no |x| tensor written: over a
    BERT-base graph `abs().amax()` was a third of a shape propagation."""

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if isinstance(result, torch.Tensor) and result.is_floating_point():
            if result.numel():
                lo, hi = (float(v) for v in torch.aminmax(result.detach()))
                n.meta["amax"] = math.nan if math.isnan(lo + hi) else max(-lo, hi)
            else:
                n.meta["amax"] = 0.0
        else:
            n.meta.pop("amax", None)
        return result


def amax(node) -> float | None:
    """The largest magnitude of a node's floating-point output at the example, where a
    shape propagation has seen it run."""
    return node.meta.get("amax") if isinstance(node, fx.Node) else None


def metas(node) -> list:
    """The TensorMetadata of a node at the example and at every probe (None where the
    node produced no tensor); an empty list for non-nodes."""
    if not isinstance(node, fx.Node):
        return []
    return [node.meta.get("tensor_meta"), *node.meta.get("probe_meta", [])]


def _first(tm):
    while not isinstance(tm, TensorMetadata) and isinstance(tm, (list, tuple)) and tm:
        tm = tm[0]  # TensorMetadata is itself a NamedTuple: test it first
    return tm if isinstance(tm, TensorMetadata) else None


def shapes_seen(node) -> list[tuple[int, ...]]:
    """The (first) tensor's shape at the example and at each probe, where known."""
    out = []
    for tm in metas(node):
        tm = _first(tm)
        if tm is not None:
            out.append(tuple(int(s) for s in tm.shape))
    return out


def strides_seen(node) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(shape, stride) of the (first) tensor at the example and at each probe."""
    out = []
    for tm in metas(node):
        tm = _first(tm)
        if tm is not None:
            out.append((tuple(int(s) for s in tm.shape), tuple(int(s) for s in tm.stride)))
    return out


def dynamic_dims(node) -> set[int]:
    """Dims of the node's (first) tensor whose size differs between the example and a
    probe: the sizes that follow a dynamic input size. Every dim when the rank moves."""
    seen = shapes_seen(node)
    if not seen:
        return set()
    base = seen[0]
    out: set[int] = set()
    for other in seen[1:]:
        if len(other) != len(base):
            return set(range(len(base)))
        out.update(i for i, (a, b) in enumerate(zip(base, other, strict=True)) if a != b)
    return out


def same_everywhere(a, b) -> bool:
    """Whether nodes (or a node and a fixed shape) have the same shape at every run."""
    sa = shapes_seen(a)
    sb = shapes_seen(b) if isinstance(b, fx.Node) else [tuple(b)] * len(sa)
    return bool(sa) and len(sa) == len(sb) and all(x == y for x, y in zip(sa, sb, strict=True))


def _flatten(meta) -> list[TensorInfo]:
    if isinstance(meta, TensorMetadata):
        return [TensorInfo(tuple(int(s) for s in meta.shape), meta.dtype)]
    if isinstance(meta, torch.Tensor):
        return [TensorInfo(tuple(int(s) for s in meta.shape), meta.dtype)]
    if isinstance(meta, (list, tuple)):
        return [t for m in meta for t in _flatten(m)]
    if isinstance(meta, dict):
        return [t for m in meta.values() for t in _flatten(m)]
    return []


def infos(node: fx.Node) -> list[TensorInfo]:
    """All tensors a node produces (several for tuple outputs), in order."""
    if "tensor_meta" in node.meta:
        return _flatten(node.meta["tensor_meta"])
    if "val" in node.meta:
        return _flatten(node.meta["val"])
    return []


def info(node) -> TensorInfo | None:
    """The (first) tensor a node produces, or None for non-tensor values and constants."""
    if not isinstance(node, fx.Node):
        return None
    found = infos(node)
    return found[0] if found else None


def shape(node) -> tuple[int, ...] | None:
    i = info(node)
    return i.shape if i is not None else None
