"""Writing bags into a graph: the weight as a node, constants, and a call of
opswap::batched_embedding_bag read back per table."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.graph.ops import copy_meta
from opswap.rules._edits import call, new_const


def weight_node(gm: fx.GraphModule, weight: fx.Node | str, before: fx.Node) -> fx.Node:
    """The table as a node: a get_attr of a module's weight path, or the node itself."""
    if isinstance(weight, fx.Node):
        return weight
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(weight)


def batched_call(
    gm: fx.GraphModule,
    like: fx.Node,
    before: fx.Node,
    weight: fx.Node,
    offsets: torch.Tensor,
    indices: list[fx.Node],
    psw: list[fx.Node] | None,
    mean: bool,
    scale: fx.Node | None = None,
    bias: fx.Node | None = None,
    out_dtype: torch.dtype | None = None,
) -> list[fx.Node]:
    """opswap::batched_embedding_bag over `indices` (one [B, L] per table, stacked on dim
    1) inserted before `before`; returns one [B, D] node per table (a select of the
    output), spelled in `like`'s flavour."""
    g = gm.graph
    off = new_const(gm, before, "embedding_offsets", offsets, as_param=False)
    with g.inserting_before(before):
        idx = call(g, like, "stack", (indices, 1))
        w = call(g, like, "stack", (psw, 1)) if psw else None
        new = g.call_function(
            torch.ops.opswap.batched_embedding_bag.default,
            (weight, off, idx, w, mean, scale, bias, out_dtype),
        )
        outs = [call(g, like, "select.int", (new, 1, t)) for t in range(len(indices))]
    return outs


def take_over(new: fx.Node, old: fx.Node) -> None:
    copy_meta(new, old)
    old.replace_all_uses_with(new)
