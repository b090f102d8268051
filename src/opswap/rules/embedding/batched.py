"""embedding.batched: the bags of several tables looked up from one batch -> one
opswap::batched_embedding_bag over the tables concatenated.

A recommender looks up tens to hundreds of tables per sample; as written, each is its own
gather (an embedding bag, or a lookup and a pooling), a launch that reads a few KB. Bags
of one shape (indices [B, L] of the same batch and bag length, tables of one width and
dtype, the same pooling, all weighted or none) become one launch: the tables are stored
as one weight with each table's first row in `offsets`, the indices stacked to
[B, T, L], and each table's [B, D] read back from the [B, T, D] result. On the CPU the op
is one F.embedding_bag over every bag at once.

Exact: the same rows summed in the same dtype (in another order than a per-table
F.embedding_bag may use). Tables must be constants (weights), not computed tensors.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.shapes import shapes_seen
from opswap.rules._cost import saving
from opswap.rules._edits import erase
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.embedding import _install, _read
from opswap.rules.registry import register
from opswap.targets.base import Target


def _shape_key(bag: _read.Bag) -> tuple:
    """Bags that can share one launch: indices of one batch and length (at every size the
    capture saw), one width, dtype and pooling, weighted alike, from constant tables."""
    return (
        tuple(shapes_seen(bag.idx)), bag.dim, bag.dtype, bag.mean, bag.psw is None,
        bag.table.dtype if bag.table is not None else None, bag.scale is None,
    )  # fmt: skip


def group_of(gm: fx.GraphModule, node: fx.Node) -> list[_read.Bag] | str | None:
    """The bags of the anchor's shape, in graph order, when the anchor is the first."""
    me = _read.read_bag(gm, node)
    if me is None or isinstance(me, str):
        return me
    if me.table is None:
        return f"the table of {node.name} is computed, not a weight"
    if me.scale is not None:
        return None
    key = _shape_key(me)
    group = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_module"):
            continue
        b = _read.read_bag(gm, n)
        if isinstance(b, _read.Bag) and b.table is not None and _shape_key(b) == key:
            group.append(b)
    if len(group) < 2 or group[0].out is not me.out and group[0].nodes[0] is not node:
        return None
    return group


@register
class Batched(Rule):
    """Several tables' bags of one batch -> one table-batched lookup. Exact."""

    name = "embedding.batched"
    family = "embedding"
    chapter = 18
    exactness = "exact"
    after = ("embedding.bag",)
    relieves = ("memory:embedding", "launch:embedding")
    anchors = ("embedding_bag", _read.BATCHED)
    description = (
        "the bags of several tables looked up from one batch (same bag shape, width, dtype "
        "and pooling) -> one opswap::batched_embedding_bag over the tables concatenated: "
        "one launch instead of one per table."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        group = group_of(gm, node)
        if group is None or isinstance(group, str):
            return Refused(group) if isinstance(group, str) else None
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        inputs = [b.idx for b in group] + [b.psw for b in group if b.psw is not None]
        ready = max(order[n] for n in inputs)
        for b in group:
            if any(order[u] <= ready for u in b.out.users):
                return Refused(
                    f"{b.out.name} is read before the indices of every table are computed"
                )
        first = group[0]
        rows = sum(b.rows for b in group)
        return Found(
            [n for b in group for n in b.nodes],
            f"{len(group)} tables' bags of {first.length} x {first.dim} "
            f"({', '.join(b.idx.name for b in group[:3])}{', ...' if len(group) > 3 else ''}) "
            f"-> one batched lookup over {rows} rows",
            dict(group=group),
            outputs=[b.out for b in group],
            key="+".join(b.out.name for b in group),
            record=dict(tables=len(group), rows=rows, dim=first.dim, length=first.length),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        group: list[_read.Bag] = found["group"]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        inputs = [b.idx for b in group] + [b.psw for b in group if b.psw is not None]
        after = max(inputs, key=order.__getitem__)
        before = after.next
        tables = [b.table for b in group]
        assert all(t is not None for t in tables)
        cat = torch.cat([t for t in tables if t is not None])
        sizes = [t.shape[0] for t in tables if t is not None]
        offsets = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))], device=cat.device)
        from opswap.rules._edits import new_const

        weight = new_const(gm, before, "embedding_tables", cat)
        psw = [b.psw for b in group if b.psw is not None] or None
        outs = _install.batched_call(
            gm, group[0].out, before, weight, offsets, [b.idx for b in group], psw,
            group[0].mean,
        )  # fmt: skip
        for b, new in zip(group, outs, strict=True):
            _install.take_over(new, b.out)
        erase(gm, [n for b in group for n in b.nodes])
        for b in group:
            if isinstance(b.weight, fx.Node) and not b.weight.users:
                gm.graph.erase_node(b.weight)
        from opswap.rules._edits import drop_dead_attrs

        drop_dead_attrs(gm, [b.weight for b in group if isinstance(b.weight, fx.Node)])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        group: list[_read.Bag] = found["group"]
        elt = torch.empty((), dtype=group[0].dtype).element_size()
        shp = _read.info(group[0].idx)
        batch = int(shp.shape[0]) if shp is not None else 1
        rows = batch * group[0].length * len(group)
        one = NodeCost(rows * group[0].dim, rows * (group[0].dim * elt + 8))
        return saving(
            target,
            [b.nodes[0] for b in group],
            [one],
            f"{len(group)} launches -> 1",
        )
