"""The 4-D mean XNNPACK delegates, written for a 2-D, 3-D or 4-D tensor's last dim."""

from __future__ import annotations

import operator

import torch.fx as fx

from opswap.rules._edits import call


def _as_4d(graph: fx.Graph, like: fx.Node, x: fx.node.Argument, rank: int) -> fx.Node:
    """x [B, S, H] as [B, S, H, 1]; x [N, H] as [1, N, H, 1]. XNNPACK unsqueezes only at the
    end (its preprocess refuses another dim after the partitioner took it), so the leading
    1 of the 2-D case comes from a permute, which it takes; no size is written down, so
    every dim may stay dynamic."""
    u = call(graph, like, "unsqueeze", (x, -1))
    if rank == 2:
        u = call(graph, like, "unsqueeze", (u, -1))  # [N, H, 1, 1]
        u = call(graph, like, "permute", (u, [2, 0, 1, 3]))
    return u


def mean_last(
    graph: fx.Graph, like: fx.Node, x: fx.node.Argument, rank: int, rows: int | None = None
) -> fx.Node:
    """Nodes computing x.mean(-1, keepdim=True) for x of rank 2, 3 or 4 through a 4-D mean
    over dims (2, 3) with keepdim; call inside `graph.inserting_before(...)`:

        [B, S, H] -> [B, S, H, 1] -> mean (2, 3) -> [B, S, 1, 1] -> [B, S, 1]
        [N, H]    -> [N, H, 1, 1] -permute-> [1, N, H, 1] -> mean (2, 3) -> [1, N, 1, 1] -> [N, 1]
        [N, R, W, C] -> [N * R, W, C] -> (the 3-D case) -> [N * R, W, 1] -> [N, R, W, 1]

    The 4-D case (a channels-last LayerNorm, as ConvNeXt writes it) writes `rows` (R, dim 1
    of x), which must then keep one size."""
    if rank == 4:
        if rows is None:
            raise ValueError("the mean of a rank-4 tensor's last dim needs the size of its dim 1")
        flat = call(graph, like, "flatten.using_ints", (x, 0, 1))
        m = mean_last(graph, like, flat, 3)
        return call(graph, like, "unflatten.int", (m, 0, [-1, rows]))
    u = _as_4d(graph, like, x, rank)
    m = call(graph, like, "mean.dim", (u, [2, 3], True))
    if rank == 2:
        m = call(graph, like, "flatten.using_ints", (m, 0, 1))
    return call(graph, like, "flatten.using_ints", (m, -2, -1))


def max_last(graph: fx.Graph, like: fx.Node, x: fx.node.Argument, rank: int) -> fx.Node:
    """Nodes computing x.amax(-1, keepdim=True) for x of rank 2 or 3 through max.dim over
    dim 2 of a 4-D view, the only max XNNPACK delegates (MaxDimConfig: a 4-D input, the
    values alone read)."""
    u = _as_4d(graph, like, x, rank)
    both = call(graph, like, "max.dim", (u, 2, True))
    m = graph.call_function(operator.getitem, (both, 0))
    if rank == 2:
        m = call(graph, like, "flatten.using_ints", (m, 0, 1))
    return call(graph, like, "flatten.using_ints", (m, -2, -1))
