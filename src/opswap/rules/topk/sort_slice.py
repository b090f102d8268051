"""topk.sort_slice: a sort cut to its head -> torch.topk.

`torch.sort(x, dim, descending)` whose values and/or indices are read only as `[..., :k]`
along the sorted dim, and `argsort(x)[..., :k]` (with `gather(x, dim, idx)` of the values),
become `torch.topk(x, k, dim, largest=descending, sorted=True)`: the same k values in the
same order, at O(n log k) instead of a full O(n log n) sort that writes n values and n
int64 indices per row.

On a dim that changes size between calls the rewrite asks for min(k, n) entries, as the
slice clamps to a shorter row.

Semantics. Values are identical, NaN included (both order NaN above +inf). Indices are
identical where the row has no ties; among equal values torch.topk promises no order, so
indices may differ there. A graph that reads only the values (or gathers x itself with the
indices) cannot see that; one that uses the indices for something else (gathers another
tensor, returns them) is accepted unless the sort asked for `stable=True`, whose promise
(ties in index order) topk does not keep: that site is refused.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.ops import copy_meta, is_aten
from opswap.rules._cost import saving
from opswap.rules._edits import call, erase
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.rules.topk import _read
from opswap.targets.base import Target


def topk_cost(head: _read.Head, rows: int, elt: int) -> NodeCost:
    """One top-k: reads the rows, writes k values and k int64 indices a row."""
    log_k = max(1, head.k.bit_length())
    return NodeCost(rows * head.n * log_k, rows * (head.n * elt + head.k * (elt + 8)))


@register
class SortSlice(Rule):
    """sort + [:k] and argsort + [:k] (+ gather) -> topk. Exact: identical values; the
    indices differ only among equal values, and a stable sort whose indices are used is
    refused."""

    name = "topk.sort_slice"
    family = "topk"
    chapter = 17
    exactness = "exact"
    relieves = ("compute:reduction", "memory:reduction")
    anchors = ("sort",)
    description = (
        "torch.sort(x)[..., :k] (values and/or indices) and argsort(x)[..., :k] (+ gather of "
        "x) -> torch.topk(x, k, sorted=True): the head without sorting the rest."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        head = _read.read(gm, node)
        if head is None:
            return None
        if isinstance(head, str):
            return Refused(head)
        if head.stable and _read.uses_indices(head):
            return Refused(
                f"{node.name} asks for a stable sort and its indices are used; torch.topk "
                "promises no order among equal values"
            )
        xi = _read.info(head.x)
        rows = (xi.numel // max(head.n, 1)) if xi is not None else 0
        order = "largest" if head.descending else "smallest"
        return Found(
            head.nodes + head.gathers,
            f"sort of {head.x.name} over dim {head.dim} ({head.n}) cut to {head.k} -> "
            f"topk({head.k}, {order})",
            dict(head=head, rows=rows),
            key=f"{node.name}[:{head.k}]",
            outputs=[
                n for n in (head.values_out, head.indices_out, *head.gathers) if n is not None
            ],
            record=dict(x=head.x.name, k=head.k, dim=head.dim, largest=head.descending),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        head: _read.Head = found["head"]
        g = gm.graph
        with g.inserting_before(head.sort):
            k: fx.node.Argument = head.k
            if head.dynamic:  # a slice clamps [:k] to a shorter row: so does the topk
                if is_aten(head.sort):
                    size = call(g, head.sort, "sym_size.int", (head.x, head.dim))
                else:
                    size = g.call_method("size", (head.x, head.dim))
                k = g.call_function(torch.sym_min, (head.k, size))
            top = call(g, head.sort, "topk", (head.x, k, head.dim, head.descending, True))
            vals = g.call_function(operator.getitem, (top, 0))
            idx = g.call_function(operator.getitem, (top, 1))
        if head.values_out is not None:
            copy_meta(vals, head.values_out)
            head.values_out.replace_all_uses_with(vals)
        for gather in head.gathers:
            if "val" not in vals.meta:
                copy_meta(vals, gather)
            gather.replace_all_uses_with(vals)
        if head.indices_out is not None:
            copy_meta(idx, head.indices_out)
            head.indices_out.replace_all_uses_with(idx)
        erase(gm, [*head.nodes, *head.gathers])
        for n in (vals, idx):
            if not n.users:
                g.erase_node(n)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        head: _read.Head = found["head"]
        xi = _read.info(head.x)
        elt = xi.dtype.itemsize if xi is not None else 4
        removed = [n for n in (head.sort, *head.gathers) if n is not None]
        return saving(
            target,
            removed,
            [topk_cost(head, found["rows"], elt)],
            f"full sort of {head.n} -> top {head.k}",
        )
