"""Values an attention pattern reads that do not depend on the inputs' data: the scale
(a number, `sqrt(d)` from a size, a 0-d constant tensor) and masks built from sizes and
buffers only (a causal `triu` crop, transformers' masking utilities without a padding
mask), evaluated at the example's shapes, at every probe's, and at lengths the capture
never ran (`Length`).

A mask that is exactly causal (or hides nothing) at every length the model may be
called at is what lets `attention.sdpa` pass `is_causal=True` (or no mask) instead of
the mask. Two lengths are not enough: a sliding-window mask (keys within 24 of the
query) is exactly causal at lengths 16 and 15 and not at 40. So the mask is also
evaluated at lengths read off its construction: just below, at and above every number
and every constant tensor's size its ops use (the window 24, a 128-long buffer cropped
to the length), and at multiples of the longest length the capture ran. Sizes at such a
length come from the runs: a size that equals the keys' length at every run is the
length, one that never moves is a constant, one that moves with the batch only keeps
the example's value, and a linear function of the length is extended as one; any other
size leaves the mask unproven, and it stays an explicit tensor. A length where the mask
cannot be built (past a buffer's end) is one where the model fails too, and is skipped.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import Argument

from opswap.graph.ops import attr_tensor, module_of, op_kind, raw_name
from opswap.graph.shapes import dynamic_dims, info, metas, shapes_seen


@dataclass
class Term:
    """One thing done to the scores between the scale and the softmax: `add` a tensor,
    `fill` with `value` where the bool `tensor` is True, or `keep` only where it is True
    (the rest filled with `value`)."""

    kind: str
    tensor: fx.Node
    value: float = 0.0


#: masks larger than this many elements are not evaluated (a causal proof is then not tried)
_MAX_NUMEL = 1 << 24
_SIZE_NAMES = ("size", "sym_size")


class NotStatic(Exception):
    """The value depends on an input's data (or on something not evaluated here)."""


#: the longest length a mask is evaluated at (its bool tensor is LONGEST**2 elements)
LONGEST = 8192


class Length:
    """A length of the keys the capture did not run at: the size of a node at it is read
    off the runs, relative to the keys' length of `scores` (see the module docstring)."""

    def __init__(self, n: int, scores: fx.Node) -> None:
        self.n = n
        self.keys = [s[-1] for s in shapes_seen(scores)]

    def size(self, x: fx.Node, d: int) -> int:
        seen = shapes_seen(x)
        if len(seen) != len(self.keys) or not seen or any(len(s) != len(seen[0]) for s in seen):
            raise NotStatic
        vals = [int(s[d]) for s in seen]
        k0, v0 = self.keys[0], vals[0]
        if len(set(vals)) == 1:
            return v0
        if vals == self.keys:
            return self.n
        moved = [(k, v) for k, v in zip(self.keys, vals, strict=True) if k != k0]
        if not moved:
            raise NotStatic
        k1, v1 = moved[0]
        a, rem = divmod(v1 - v0, k1 - k0)
        b = v0 - a * k0
        follows = rem == 0 and all(v == a * k + b for k, v in moved)
        if not follows or (
            a != 0 and any(v != v0 for k, v in zip(self.keys, vals, strict=True) if k == k0)
        ):
            raise NotStatic  # moves with the length and with something else
        return a * self.n + b if a else v0

    def shape(self, x: fx.Node) -> torch.Size:
        seen = shapes_seen(x)
        if not seen:
            raise NotStatic
        return torch.Size(self.size(x, d) for d in range(len(seen[0])))


Run = int | Length | None


def _size_of(node: fx.Node, run: Run) -> int:
    """`x.size(d)` / `aten.sym_size.int(x, d)`: at run `run`, or the static size (run None)."""
    x = node.args[0]
    if not isinstance(x, fx.Node) or len(node.args) < 2 or not isinstance(node.args[1], int):
        raise NotStatic
    return _dim_of(x, node.args[1], run)


def _shape_item(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, d) for `x.shape[d]` (FX records `getattr(x, "shape")` then `getitem`), else None."""
    if raw_name(node) != "getitem" or len(node.args) != 2 or not isinstance(node.args[1], int):
        return None
    shape = node.args[0]
    if not isinstance(shape, fx.Node) or raw_name(shape) != "getattr":
        return None
    if shape.args[1:] != ("shape",) or not isinstance(shape.args[0], fx.Node):
        return None
    return shape.args[0], node.args[1]


def _dim_of(x: fx.Node, d: int, run: Run) -> int:
    """Size `d` of `x` at run `run`, or where that one dim is static (run None): the head
    size `q.shape[-1]` is static while q's batch and length move."""
    if isinstance(run, Length):
        return run.size(x, d)
    if run is None:
        xi = info(x)
        if xi is None or d % max(len(xi.shape), 1) in dynamic_dims(x):
            raise NotStatic
        return int(xi.shape[d])
    seen = metas(x)
    tm = seen[run] if run < len(seen) else None
    if tm is None or not hasattr(tm, "shape"):
        raise NotStatic
    return int(tm.shape[d])


def _shape_of(x: Argument, run: Run) -> torch.Size:
    """`x.shape` at run `run`, or when every dim of it is static (run None)."""
    if not isinstance(x, fx.Node):
        raise NotStatic
    if isinstance(run, Length):
        return run.shape(x)
    seen = shapes_seen(x)
    if not seen or (run is None and dynamic_dims(x)) or (run is not None and run >= len(seen)):
        raise NotStatic
    return torch.Size(seen[0 if run is None else run])


def evaluate(
    gm: fx.GraphModule, value: Any, run: Run = None, memo: dict[fx.Node, Any] | None = None
) -> Any:
    """The value of `value` computed from constants and sizes only: at the shapes of run
    `run` (0 the example, 1.. the probes; a Length: a length no run had), or, with run
    None, only where it is the same at every shape (a static size). NotStatic when it
    reads an input's data."""
    memo = {} if memo is None else memo
    if isinstance(value, (list, tuple)):
        return type(value)(evaluate(gm, v, run, memo) for v in value)
    if isinstance(value, dict):
        return {k: evaluate(gm, v, run, memo) for k, v in value.items()}
    if not isinstance(value, fx.Node):
        return value
    if value in memo:
        return memo[value]
    node = value
    if node.op == "get_attr":
        out: Any = attr_tensor(gm, node)
        if out is None:
            raise NotStatic
    elif node.op in ("placeholder", "output"):
        raise NotStatic
    elif raw_name(node) in _SIZE_NAMES:
        out = _size_of(node, run)
    elif (item := _shape_item(node)) is not None:
        out = _dim_of(*item, run)
    elif raw_name(node) == "getattr" and node.args[1:] == ("shape",):
        out = _shape_of(node.args[0], run)
    elif raw_name(node) == "getattr" and node.args[1:] == ("dtype",) and (xi := info(node.args[0])):
        out = xi.dtype  # `torch.tensor(d, dtype=q.dtype)`
    elif node.op == "call_module":
        mod = module_of(node)
        if op_kind(node) not in ("dropout", "identity") or (mod is not None and mod.training):
            raise NotStatic
        out = evaluate(gm, node.args[0], run, memo)
    else:
        for n in node.all_input_nodes:
            ni = info(n)
            if ni is not None and ni.numel > _MAX_NUMEL and not isinstance(run, Length):
                raise NotStatic
        args = evaluate(gm, node.args, run, memo)
        kwargs = evaluate(gm, dict(node.kwargs), run, memo)
        with torch.no_grad():
            if node.op == "call_method":
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                out = node.target(*args, **kwargs)  # type: ignore[operator]
    memo[node] = out
    return out


def number(gm: fx.GraphModule, value: Any) -> float | None:
    """`value` as a number that is the same at every shape (a constant, `d ** 0.5` of a
    static size, a 0-d constant tensor), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, fx.Node):
        return None
    i = info(value)
    if i is not None and i.numel != 1:
        return None
    try:
        out = evaluate(gm, value)
    except (NotStatic, RuntimeError, TypeError, ValueError):
        return None
    if isinstance(out, torch.Tensor):
        return float(out.item()) if out.numel() == 1 else None
    return float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) else None


def runs(node: fx.Node) -> int:
    """How many shapes the capture ran `node` at (the example and the probes)."""
    return len(shapes_seen(node))


def masked(gm: fx.GraphModule, terms: Sequence[Term], run: int | Length) -> torch.Tensor | None:
    """Where the mask `terms` (see Term) hides a key at run `run`, as a bool tensor,
    when the terms hide keys and add nothing else (0 elsewhere); None when a term is not
    static or adds values other than 0 and the large negative ones."""
    hidden: torch.Tensor | None = None
    memo: dict = {}
    for t in terms:
        try:
            m = evaluate(gm, t.tensor, run, memo)
        except (NotStatic, RuntimeError, TypeError, ValueError, IndexError):
            return None
        if not isinstance(m, torch.Tensor):
            return None
        if t.kind == "add":
            if m.dtype == torch.bool:
                return None
            big = m <= -1e30
            if not torch.all((m == 0) | big):
                return None
            m = big
        elif t.kind == "keep":
            m = ~m.bool()
        else:  # "fill": True where the fill applies
            m = m.bool()
        hidden = m if hidden is None else operator.or_(hidden, m)
    return hidden


def _subgraph(terms: Sequence[Term]) -> list[fx.Node]:
    """The nodes the mask `terms` are computed from (placeholders excluded)."""
    todo = [t.tensor for t in terms]
    seen: dict[fx.Node, None] = {}
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen or n.op in ("placeholder", "output"):
            continue
        seen[n] = None
        todo += n.all_input_nodes
    return list(seen)


def lengths(
    gm: fx.GraphModule, terms: Sequence[Term], scores: fx.Node
) -> tuple[list[Length], list[Length]]:
    """The lengths no run had at which the mask `terms` is also judged: (from its
    construction) one below, at and one above each number its ops use and each size of
    the constant tensors they read; (beyond the runs) 2 and 4 times the longest keys'
    length the capture ran. None past LONGEST, and none when every run had the same keys'
    length: the length is then static, and the model accepts no other."""
    ran = {s[-1] for s in shapes_seen(scores)}
    if len(ran) < 2:
        return [], []
    numbers: set[int] = set()
    for n in _subgraph(terms):
        if n.op == "get_attr":
            numbers.update(int(s) for s in getattr(attr_tensor(gm, n), "shape", ()))
        for a in (*n.args, *n.kwargs.values()):
            for v in a if isinstance(a, (list, tuple)) else (a,):
                # a slice's "to the end" (sys.maxsize) is not a length
                if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 2**31:
                    numbers.add(int(v))
    built = {c + e for c in numbers for e in (-1, 0, 1)} - ran
    beyond = {max(ran, default=0) * f for f in (2, 4)} - ran - built
    return (
        [Length(n, scores) for n in sorted(built) if 2 <= n],
        [Length(n, scores) for n in sorted(beyond) if 2 <= n <= LONGEST],
    )


def _affordable(terms: Sequence[Term], scores: fx.Node, run: Length) -> bool:
    """Whether the mask's largest value at `run` stays under _MAX_NUMEL * 8 elements (its
    size at the example, scaled by the square of the lengths' ratio)."""
    keys = shapes_seen(scores)
    if not keys or run.n > LONGEST:
        return False
    scale = (run.n / max(keys[0][-1], 1)) ** 2
    biggest = max((i.numel for i in map(info, _subgraph(terms)) if i is not None), default=0)
    return biggest * scale <= _MAX_NUMEL * 8


def _at(scores: fx.Node, run: int | Length) -> tuple[int, ...] | None:
    """The scores' shape at `run` (a Length: the example's with its keys' and queries'
    lengths read as Length.size reads them)."""
    if isinstance(run, Length):
        try:
            return tuple(run.shape(scores))
        except NotStatic:
            return None
    seen = shapes_seen(scores)
    return seen[run] if run < len(seen) else None


def _judged(
    gm: fx.GraphModule,
    terms: Sequence[Term],
    scores: fx.Node,
    want: Callable[[int, int], torch.Tensor],
) -> bool:
    """Whether the mask `terms` hides exactly `want(queries, keys)` (a bool [queries, keys]
    tensor, broadcast over the scores' other dims) at every run of the capture and at every
    `lengths` length where the mask can be built; False where a size cannot be read off
    the runs, or a length read off the mask's construction is too long to check."""
    if not terms or not shapes_seen(scores):
        return False
    built, beyond = lengths(gm, terms, scores)
    if not all(_affordable(terms, scores, r) for r in built):
        return False
    runs: list[int | Length] = [*range(len(shapes_seen(scores))), *built]
    runs += [r for r in beyond if _affordable(terms, scores, r)]
    for run in runs:
        shape = _at(scores, run)
        if shape is None:
            return False
        hidden = masked(gm, terms, run)
        if hidden is None:
            if isinstance(run, Length) and _unbuildable(gm, terms, run):
                continue  # the model cannot be called at this length either
            return False
        try:
            fits = torch.broadcast_shapes(hidden.shape, shape) == torch.Size(shape)
        except RuntimeError:
            fits = False
        if not fits:
            if isinstance(run, Length):
                continue  # a mask that does not fit the scores: the model fails here too
            return False
        q, k = shape[-2:]
        lead = hidden.shape[:-2] if hidden.dim() >= 2 else torch.Size()
        if not torch.equal(hidden.expand(*lead, q, k), want(q, k).expand(*lead, q, k)):
            return False
    return True


def _unbuildable(gm: fx.GraphModule, terms: Sequence[Term], run: Length) -> bool:
    """Whether a term's value raises (rather than reads data or an unknown size) at `run`."""
    memo: dict = {}
    for t in terms:
        try:
            evaluate(gm, t.tensor, run, memo)
        except NotStatic:
            return False
        except (RuntimeError, TypeError, ValueError, IndexError):
            return True
    return False


def causal(gm: fx.GraphModule, terms: Sequence[Term], scores: fx.Node) -> bool:
    """Whether the terms hide exactly the future keys (key j > query i) of square scores,
    at every shape the capture ran and at every length read off the mask's construction:
    the mask SDPA's `is_causal` applies."""

    def future(q: int, k: int) -> torch.Tensor:
        if q != k:
            return torch.zeros(0, dtype=torch.bool)  # never equal to a [q, k] mask
        return torch.ones(q, k, dtype=torch.bool).triu(1)

    return _judged(gm, terms, scores, future)


def hides_nothing(gm: fx.GraphModule, terms: Sequence[Term], scores: fx.Node) -> bool:
    """Whether the terms are static and add 0 everywhere at every shape the capture ran and
    at every length read off the mask's construction (transformers' bidirectional mask
    without padding): no mask at all."""
    return _judged(gm, terms, scores, lambda q, k: torch.zeros(q, k, dtype=torch.bool))
