"""pooling.adaptive_avg_mean: AdaptiveAvgPool to size 1 -> a mean over the spatial dims.

An adaptive average pool to 1 (ResNet's, MobileNet's and EfficientNet's head) is the mean
of each channel; written as `x.mean(dims)` it runs PyTorch's reduction kernel, which
measured a little faster on the CPU (1.3x at 1 x 512 x 7 x 7, 1.1x at batch 8, one
thread; benchmarks/bench_pooling.py), and a `flatten(1)` after it folds away (keepdim=False gives
[N, C] directly). Exact: the same sum over the same elements divided by their count.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import op_kind
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import replace_with
from opswap.rules._matching import input_of, setting
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.pooling._pool import rank_of
from opswap.rules.registry import register


def _all_ones(size: Any) -> bool | None:
    """True for 1 or (1, ..., 1); None when a dim is None (kept at the input's size)."""
    if isinstance(size, int):
        return size == 1
    if isinstance(size, (list, tuple)) and size:
        if any(s is None for s in size):
            return None
        return all(s == 1 for s in size)
    return False


def _flattens_rest(node: fx.Node, rank: int) -> bool:
    """Whether `node` is flatten(start_dim=1, end_dim=-1) of a rank-`rank` tensor."""
    if op_kind(node) != "flatten":
        return False
    start, end = setting(node, "start_dim", 0), setting(node, "end_dim", -1)
    return start == 1 and end in (-1, rank - 1)


@register
class AdaptiveAvgMean(Rule):
    """AdaptiveAvgPool{1,2,3}d(1) -> mean over the pooled dims (keepdim), and with the
    flatten(1) after it folded -> mean without keepdim."""

    name = "pooling.adaptive_avg_mean"
    training = True
    family = "pooling"
    chapter = 13
    exactness = "exact"
    relieves = ("memory:pooling",)
    anchors = ("adaptive_avg_pool",)
    description = (
        "AdaptiveAvgPool to 1 (a global average pool) -> x.mean over the spatial dims, the "
        "flatten(1) after it folded: PyTorch's reduction kernel instead of the pooling one."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        x = input_of(node)
        d = rank_of(node)
        if x is None or d is None:
            return None
        ones = _all_ones(setting(node, "output_size", None))
        if ones is None:
            return Refused(
                f"{node.name} keeps a dim at the input's size (output size "
                f"{setting(node, 'output_size', None)}), so it is not a mean over all of them"
            )
        if not ones:
            return None
        xi = info(x)
        if xi is None:
            return Refused(f"the shape of {x.name} is unknown")
        if not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is {xi.dtype}; a mean takes floating-point tensors")
        dims = list(range(-d, 0))
        users = list(node.users)
        rank = len(xi.shape)
        if len(users) == 1 and rank == d + 2 and _flattens_rest(users[0], rank):
            flat = users[0]
            return Found(
                (node, flat),
                f"{node.name} + {flat.name}: global average pool and flatten -> "
                f"mean over dims {dims}",
                dict(x=x, dims=dims, keepdim=False),
            )
        return Found(
            (node,),
            f"{node.name}: global average pool -> mean over dims {dims}",
            dict(x=x, dims=dims, keepdim=True),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        args = (found["x"], found["dims"], found["keepdim"])
        replace_with(gm, found.nodes[-1], "mean.dim", args, remove=found.nodes)

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        pool = found.nodes[0]
        c = node_cost(pool)
        return saving(
            target,
            found.nodes,
            [NodeCost(c.flops, c.bytes)],
            "the same reduction as a mean"
            + (", the flatten folded" if len(found.nodes) > 1 else ""),
        )
