"""Grouped-query attention as written out: k and v repeated per query head (HF's
repeat_kv, or repeat_interleave on the head dim), which SDPA takes unrepeated with
`enable_gqa=True` (query head h reads kv head h // n, as the repeat does)."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from opswap.graph.ops import arg, op_kind, raw_name
from opswap.graph.shapes import info


def _noop_slice(n: fx.Node) -> bool:
    if raw_name(n) != "slice" or n.op != "call_function" or not n.args:
        return False
    a, b = info(n.args[0]), info(n)
    return a is not None and b is not None and a.shape == b.shape


def _skip_slices(cur: Any, nodes: list) -> Any:
    while isinstance(cur, fx.Node) and _noop_slice(cur) and len(cur.users) == 1:
        nodes.append(cur)
        cur = cur.args[0]
    return cur


def repeated(x: fx.Node) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """(kv, n, nodes) when x repeats each head of kv n times along dim 1 (HF's repeat_kv:
    [:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d), or repeat_interleave)."""
    xi = info(x)
    if xi is None or len(xi.shape) != 4 or len(x.users) != 1:
        return None
    if raw_name(x) == "repeat_interleave":
        n, dim, base = arg(x, 1, "repeats"), arg(x, 2, "dim"), x.args[0]
        if isinstance(base, fx.Node) and isinstance(n, int) and dim in (1, -3):
            return base, n, [x]
        return None
    if op_kind(x) not in ("reshape", "view"):
        return None
    nodes = [x]
    e = _skip_slices(x.args[0], nodes)
    if not isinstance(e, fx.Node) or op_kind(e) != "expand" or len(e.users) != 1:
        return None
    nodes.append(e)
    u = _skip_slices(e.args[0], nodes)
    if not isinstance(u, fx.Node) or raw_name(u) != "unsqueeze" or len(u.users) != 1:
        return None
    if arg(u, 1, "dim") not in (2, -3):
        return None
    nodes.append(u)
    base = _skip_slices(u.args[0], nodes)
    if not isinstance(base, fx.Node):
        return None
    bi, ei = info(base), info(e)
    if not isinstance(base, fx.Node) or bi is None or ei is None or len(bi.shape) != 4:
        return None
    bb, h, s, d = bi.shape
    n = ei.shape[2] if len(ei.shape) == 5 else 0
    if ei.shape != (bb, h, n, s, d) or xi.shape != (bb, h * n, s, d):
        return None
    return base, int(n), nodes
