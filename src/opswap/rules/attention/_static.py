"""Values an attention pattern reads that do not depend on the inputs' data: the scale
(a number, `sqrt(d)` from a size, a 0-d constant tensor) and masks built from sizes and
buffers only (a causal `triu` crop, transformers' masking utilities without a padding
mask), evaluated at the example's shapes and at every probe's.

A mask that is the same function of the sizes at every shape the capture ran is what
lets `attention.sdpa` say "exactly causal" and pass `is_causal=True` instead of a mask.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from opswap.graph.ops import attr_tensor, module_of, op_kind, raw_name
from opswap.graph.shapes import dynamic_dims, info, metas, shapes_seen

#: masks larger than this many elements are not evaluated (a causal proof is then not tried)
_MAX_NUMEL = 1 << 24
_SIZE_NAMES = ("size", "sym_size")


class NotStatic(Exception):
    """The value depends on an input's data (or on something not evaluated here)."""


def _size_of(node: fx.Node, run: int | None) -> int:
    """`x.size(d)` / `aten.sym_size.int(x, d)`: at run `run`, or the static size (run None)."""
    x = node.args[0]
    if not isinstance(x, fx.Node) or len(node.args) < 2 or not isinstance(node.args[1], int):
        raise NotStatic
    d = node.args[1]
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


def _shape_of(x, run: int | None) -> torch.Size:
    """`x.shape` at run `run`, or when every dim of it is static (run None)."""
    if not isinstance(x, fx.Node):
        raise NotStatic
    seen = shapes_seen(x)
    if not seen or (run is None and dynamic_dims(x)) or (run is not None and run >= len(seen)):
        raise NotStatic
    return torch.Size(seen[0 if run is None else run])


def evaluate(gm: fx.GraphModule, value: Any, run: int | None = None, memo=None) -> Any:
    """The value of `value` computed from constants and sizes only: at the shapes of run
    `run` (0 the example, 1.. the probes), or, with run None, only where it is the same
    at every shape (a static size). NotStatic when it reads an input's data."""
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
    elif raw_name(node) == "getattr" and node.args[1:] == ("shape",):
        out = _shape_of(node.args[0], run)
    elif node.op == "call_module":
        mod = module_of(node)
        if op_kind(node) not in ("dropout", "identity") or (mod is not None and mod.training):
            raise NotStatic
        out = evaluate(gm, node.args[0], run, memo)
    else:
        for n in node.all_input_nodes:
            ni = info(n)
            if ni is not None and ni.numel > _MAX_NUMEL:
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


def masked(gm: fx.GraphModule, terms, run: int) -> torch.Tensor | None:
    """Where the mask `terms` (see _match.Term) hides a key at run `run`, as a bool tensor,
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


def causal(gm: fx.GraphModule, terms, scores: fx.Node) -> bool:
    """Whether the terms hide exactly the future keys (key j > query i) of square scores,
    at every shape the capture ran: the mask SDPA's `is_causal` applies."""
    seen = shapes_seen(scores)
    if not terms or not seen:
        return False
    for run, shape in enumerate(seen):
        sq, sk = shape[-2], shape[-1]
        if sq != sk:
            return False
        hidden = masked(gm, terms, run)
        if hidden is None:
            return False
        want = torch.ones(sq, sk, dtype=torch.bool).triu(1)
        try:
            full = torch.broadcast_to(hidden, shape)
        except RuntimeError:
            return False
        if not torch.equal(full, want.expand(shape)):
            return False
    return True


def hides_nothing(gm: fx.GraphModule, terms, scores: fx.Node) -> bool:
    """Whether the terms are static and add 0 everywhere at every shape the capture ran
    (transformers' bidirectional mask without padding): no mask at all."""
    seen = shapes_seen(scores)
    if not terms or not seen:
        return False
    for run in range(len(seen)):
        hidden = masked(gm, terms, run)
        if hidden is None or bool(hidden.any()):
            return False
    return True
