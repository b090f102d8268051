"""Reading a sort and the slice of its head: what `topk.sort_slice` matches.

`read(gm, node)` answers at a `sort` / `argsort` node with a `Head` (the sorted tensor, the
dim, the order, k, and the nodes that read the first k values / indices), a reason it does
not qualify, or None when nothing slices it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch.fx.node import Argument

from opswap.graph.ops import copy_meta, op_kind, raw_name
from opswap.graph.shapes import dynamic_dims, info
from opswap.rules._matching import setting

#: an end this large (or None) is "to the end of the dim" in a captured slice
_TO_END = 2**62


@dataclass
class Head:
    """x.sort(dim, descending)[:k] read as values and/or indices."""

    sort: fx.Node
    x: fx.Node
    dim: int
    descending: bool
    stable: bool
    k: int
    n: int
    values_out: fx.Node | None = None  # the node holding the first k values
    indices_out: fx.Node | None = None  # ... the first k indices
    dynamic: bool = False  # the sorted dim changes size between calls
    gathers: list[fx.Node] = field(default_factory=list)  # gather(x, dim, head indices)
    nodes: list[fx.Node] = field(default_factory=list)  # every node the rewrite removes


def _full(s: Argument) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def _head_slice(s: Argument) -> int | None:
    """k for a slice [:k] (start 0, step 1, a constant positive end), else None."""
    if not isinstance(s, slice) or s.start not in (None, 0) or s.step not in (None, 1):
        return None
    return s.stop if isinstance(s.stop, int) and not isinstance(s.stop, bool) else None


def _index_k(idx: Argument, dim: int, ndim: int) -> int | None:
    """k for an FX index `t[..., :k]` over `dim` (every other dim taken whole), else None."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = ndim - (len(items) - 1)
        if fill < 0:
            return None
        items = items[:at] + [slice(None)] * fill + items[at + 1 :]
    if len(items) > ndim:
        return None
    items += [slice(None)] * (ndim - len(items))
    if not all(_full(s) for i, s in enumerate(items) if i != dim):
        return None
    return _head_slice(items[dim])


def _slice_chain(t: fx.Node, dim: int, ndim: int) -> tuple[int, fx.Node, list[fx.Node]] | None:
    """(k, the node holding t's first k entries along dim, the chain's nodes) when t's only
    reader takes its head along `dim`: an FX `t[..., :k]`, or torch.export's chain of
    aten.slice (whole slices of other dims and one [0:k] of dim)."""
    if len(t.users) != 1:
        return None
    return _chain_from(t, next(iter(t.users)), dim, ndim)


def _chain_from(
    t: fx.Node, u: fx.Node, dim: int, ndim: int
) -> tuple[int, fx.Node, list[fx.Node]] | None:
    """`_slice_chain` through t's reader `u`."""
    if u.op == "call_function" and u.target is operator.getitem and u.args[0] is t:
        head = _index_k(u.args[1], dim, ndim)
        return None if head is None else (head, u, [u])
    chain: list[fx.Node] = []
    k: int | None = None
    cur = t
    while True:
        if chain and len(cur.users) != 1:
            break
        nxt = u if not chain else next(iter(cur.users))
        if raw_name(nxt) != "slice" or op_kind(nxt) != "slice":
            break
        if nxt.args[0] is not cur:
            break
        d = setting(nxt, "dim", 0)
        start, end, step = (setting(nxt, a, None) for a in ("start", "end", "step"))
        if not isinstance(d, int) or step not in (None, 1) or start not in (None, 0):
            return None
        d %= ndim
        whole = end is None or (isinstance(end, int) and end >= _TO_END)
        if d == dim and not whole:
            if k is not None or not isinstance(end, int):
                return None
            k = end
        elif not whole:
            return None
        chain.append(nxt)
        cur = nxt
    return None if k is None else (k, cur, chain)


def _outputs(sort: fx.Node) -> list[tuple[int, fx.Node]] | None:
    """(0 for values or 1 for indices, node) for each of a sort's readers (getitem or
    .values / .indices); None when something else reads the pair."""
    out: list[tuple[int, fx.Node]] = []
    for u in sort.users:
        if u.op != "call_function":
            return None
        if u.target is operator.getitem and u.args[1] in (0, 1):
            i = int(u.args[1])  # type: ignore[arg-type]
        elif u.target is getattr and u.args[1] in ("values", "indices"):
            i = 0 if u.args[1] == "values" else 1
        else:
            return None
        out.append((i, u))
    return out


def read(gm: fx.GraphModule, node: fx.Node) -> Head | str | None:
    """The sort (or argsort) at `node` cut to its head, a reason why not, or None."""
    name = raw_name(node)
    if name not in ("sort", "argsort") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x = node.args[0]
    xi = info(x)
    if xi is None or not xi.shape:
        return None
    ndim = len(xi.shape)
    dim = setting(node, "dim", -1)
    if not isinstance(dim, int):
        return None
    dim %= ndim
    descending = bool(setting(node, "descending", False))
    stable = bool(setting(node, "stable", False))
    n = int(xi.shape[dim])
    outs: list[tuple[int, fx.Node]]
    if name == "argsort":
        outs = [(1, node)]
    else:
        got = _outputs(node)
        if got is None:
            return None
        outs = got
    head = Head(
        node,
        x,
        dim,
        descending,
        stable,
        0,
        n,
        nodes=list(dict.fromkeys([node, *(t for _, t in outs)])),
    )
    ks: set[int] = set()
    whole: list[str] = []
    for i, t in outs:
        if not t.users:  # torch.export keeps an unread getitem of the pair
            continue
        chain = _slice_chain(t, dim, ndim)
        if chain is None:
            whole.append("values" if i == 0 else "indices")
            if any(_chain_from(t, u, dim, ndim) for u in t.users):
                ks.add(-1)  # a head is taken, and the whole read too: a near miss
            continue
        k, end, nodes = chain
        if (head.values_out if i == 0 else head.indices_out) is not None:
            return f"the {'values' if i == 0 else 'indices'} of {node.name} are sliced twice"
        ks.add(k)
        head.nodes += nodes
        if i == 0:
            head.values_out = end
        else:
            head.indices_out = end
    if not ks:
        return None
    if whole and ks:
        return f"the sorted {' and '.join(whole)} of {node.name} are also read whole"
    if len(ks) > 1:
        return f"the values and indices of {node.name} are cut at different k ({sorted(ks)})"
    head.k = ks.pop()
    if head.indices_out is not None:
        for g in list(head.indices_out.users):
            if (
                op_kind(g) == "slice"
                and raw_name(g) == "gather"
                and g.args[0] is x
                and isinstance(setting(g, "dim", None), int)
                and setting(g, "dim", 0) % ndim == dim
                and setting(g, "index", None) is head.indices_out
            ):
                head.gathers.append(g)
    if head.k <= 0:
        return f"{node.name} is cut to {head.k} entries; a top-k needs k >= 1"
    head.dynamic = dim in dynamic_dims(x)
    if head.k >= n:
        return f"{node.name} keeps all {n} sorted entries ([:{head.k}]); nothing to save"
    return head


def uses_indices(head: Head) -> bool:
    """Whether the head's indices reach anything but a gather of the sorted tensor itself."""
    out = head.indices_out
    return out is not None and any(u not in head.gathers for u in out.users)


def replace_pair(gm: fx.GraphModule, node: fx.Node, target: Any, args: tuple) -> fx.Node:
    """Replace the (values, indices) op `node` by a call of `target` on `args` returning the
    same pair; `.values` / `.indices` of torch's named pair become [0] / [1]."""
    g = gm.graph
    with g.inserting_before(node):
        new = g.call_function(target, args)
    copy_meta(new, node)
    for u in list(node.users):
        if u.target is getattr:
            with g.inserting_before(u):
                at = g.call_function(operator.getitem, (new, int(u.args[1] == "indices")))
            copy_meta(at, u)
            u.replace_all_uses_with(at)
            g.erase_node(u)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new
