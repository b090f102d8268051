"""pooling.pool_before_conv: a 1x1 conv followed by an average pool -> the pool first,
then the conv. Exact: both are linear maps per position, so they commute, and the conv
then runs on k*k times fewer pixels (DenseNet's transition: conv 1x1, AvgPool 2 -> a
quarter of the conv's FLOPs and of its output's traffic).

avgpool(W x + b) = W avgpool(x) + b * avgpool(1), and avgpool(1) is 1 wherever the pool
divides by the values it summed: no padding counted in (padding 0, or
count_include_pad=False) and no divisor_override; an adaptive average pool always does.
This is the "pooling fused into the producer" of chapter 13 that pays on any device
without a kernel of its own: the producer is made cheaper rather than fused.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import op_kind
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._matching import input_of
from opswap.rules._weights import weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.pooling._pool import pool
from opswap.rules.registry import register

_SHAPE_KEYS = ("tensor_meta", "val", "probe_meta")


@register
class PoolBeforeConv(Rule):
    """conv 1x1 (stride 1, no padding) -> AvgPool / AdaptiveAvgPool => pool -> conv."""

    name = "pooling.pool_before_conv"
    family = "pooling"
    chapter = 13
    exactness = "exact"
    relieves = ("compute:conv", "memory:conv", "memory:pooling")
    anchors = ("avg_pool", "adaptive_avg_pool")
    # a BatchNorm between conv and pool is folded first; the pools other rules make or
    # take (max_to_avg makes one; strided_conv and adaptive_avg_mean take them) come after
    after = ("fusion.conv_bn", "pooling.max_to_avg")
    before = ("pooling.strided_conv", "pooling.adaptive_avg_mean", "fusion.conv_relu")
    description = (
        "1x1 conv then average pool -> average pool then the 1x1 conv (exact: linear maps "
        "commute): the conv runs on k*k times fewer pixels (DenseNet transitions)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        conv = input_of(node)
        if conv is None or op_kind(conv) != "conv":
            return None
        w = weighted(gm, conv)
        if isinstance(w, str):
            return Refused(w)
        if w.transposed or any(k != 1 for k in w.weight.shape[2:]):
            return None  # only a 1x1 conv commutes with a pool
        if (
            any(s != 1 for s in w.stride)
            or isinstance(w.padding, str)
            and w.padding != "valid"
            or not isinstance(w.padding, str)
            and any(w.padding)
        ):
            return Refused(f"{conv.name} is a 1x1 conv with a stride or padding")
        if op_kind(node) == "avg_pool":
            p = pool(node)
            if isinstance(p, str):
                return Refused(p)
            if p.divisor_override is not None:
                return Refused(f"{node.name} divides by {p.divisor_override}, not the window")
            if any(p.padding) and p.count_include_pad:
                return Refused(
                    f"{node.name} counts its zero padding, where {conv.name}'s bias would "
                    "have been: pooling first would move the border values"
                )
            rank = p.rank
        else:
            rank = w.weight.dim() - 2
        if rank != w.weight.dim() - 2:
            return None
        if len(conv.users) != 1:
            others = ", ".join(u.name for u in conv.users if u is not node)
            return Refused(f"{conv.name}'s output is also read by {others}")
        x = input_of(conv)
        if x is None:
            return None
        return Found(
            (conv, node),
            f"{conv.name} (1x1) + {node.name}: pool first, then the conv on fewer pixels",
            dict(x=x, conv=conv, pool=node),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        x, conv, p = found["x"], found["conv"], found["pool"]
        p.replace_all_uses_with(conv)
        conv.update_arg(0, p)
        p.update_arg(0, x)
        p.append(conv)  # move the conv after the pool
        # the conv now yields what the pool did; the pool's own shape is re-read later
        for k in _SHAPE_KEYS:
            if k in p.meta:
                conv.meta[k] = p.meta.pop(k)

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        conv, p = found["conv"], found["pool"]
        yi, xi, oi = info(conv), info(found["x"]), info(p)
        c_conv, c_pool = node_cost(conv), node_cost(p)
        if yi is None or xi is None or oi is None or not yi.numel:
            return saving(target, [conv, p], [c_conv, c_pool])
        ratio = oi.numel / yi.numel  # pixels left after the pool
        w_bytes = max(c_conv.bytes - xi.nbytes - yi.nbytes, 0)
        new_conv = NodeCost(
            round(c_conv.flops * ratio), round(xi.nbytes * ratio) + w_bytes + oi.nbytes
        )
        new_pool = NodeCost(
            round(c_pool.flops * xi.numel / yi.numel), round(xi.nbytes * (1 + ratio))
        )
        return saving(target, [conv, p], [new_pool, new_conv], f"conv on {ratio:.2f} of the pixels")
