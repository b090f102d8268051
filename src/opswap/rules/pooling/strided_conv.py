"""pooling.strided_conv: AvgPool (kernel k, stride s) -> a depthwise conv with stride s whose
every weight is 1/prod(k). Exact at its initialisation, lossy after fine-tuning.

The conv computes the same windowed mean as long as every window divides by the full
kernel size: padding counted (count_include_pad, PyTorch's default, or no padding), no
ceil_mode (a partial last window would divide by fewer) and no divisor_override; other
pools are refused. What the swap buys is a layer that can learn: each channel's window
weights train (opswap.train.finetune_pooling), a "learned pooling" that recovers or
gains accuracy, and a conv that int8 and conv-only accelerators take where a pool is not
supported. Once trained it is a different function, so the rule is declared lossy; a
plan applied without training is exact up to rounding, which its verification shows.

Where it pays by speed: on the CPU, often. PyTorch's CPU average pool on NCHW tensors is
slow next to oneDNN's depthwise conv: AvgPool2d(2) on 1 x 64 x 56 x 56 took 0.27 ms and
the conv 0.08 ms, 7.5x at batch 8 (torch 2.13, one thread, benchmarks/bench_pooling.py). The roofline sees the same taps plus a weight, so the prediction
saves nothing and the race keeps the conv where it measures faster.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import is_aten
from opswap.graph.shapes import dynamic_dims, info
from opswap.rules._cost import saving
from opswap.rules._edits import install_module, new_const, replace_with
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.pooling._pool import Pool, read
from opswap.rules.registry import register

aten = torch.ops.aten
_CONV: dict[int, type[nn.Module]] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_FUNC = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def depthwise_mean(c: int, p: Pool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The weight [C, 1, *k] of a depthwise conv computing p's windowed mean."""
    return torch.full((c, 1, *p.kernel), 1.0 / math.prod(p.kernel), dtype=dtype, device=device)


@register
class StridedConv(Rule):
    """AvgPool{1,2,3}d -> Conv{1,2,3}d(C, C, k, stride, padding, groups=C, bias=False)
    with weights 1/prod(k): the same output at initialisation, trainable after."""

    name = "pooling.strided_conv"
    family = "pooling"
    chapter = 13
    exactness = "lossy"
    relieves = ()
    anchors = ("avg_pool",)
    description = (
        "AvgPool -> depthwise strided conv initialised to 1/k^2 (exact at init; lossy once "
        "fine-tuned): a learnable pool, and a conv for conv-only accelerators."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        got = read(node)
        if not isinstance(got, tuple):
            return got
        x, p = got
        if p.ceil_mode:
            return Refused(
                f"{node.name} uses ceil_mode, whose partial windows divide by fewer values "
                "than a conv of fixed weights does"
            )
        if p.divisor_override is not None:
            return Refused(f"{node.name} divides by {p.divisor_override}, not the window size")
        if any(p.padding) and not p.count_include_pad:
            return Refused(
                f"{node.name} pads but leaves the padding out of its count, so border windows "
                "divide by fewer values than a conv of fixed weights does"
            )
        xi = info(x)
        if xi is None or len(xi.shape) != p.rank + 2:
            return Refused(f"{x.name} is not a batch [N, C, ...] of rank {p.rank + 2}")
        if not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is {xi.dtype}; a conv takes floating-point tensors")
        if 1 in dynamic_dims(x):
            return Refused(f"the channel count of {x.name} varies between calls")
        c = int(xi.shape[1])
        return Found(
            (node,),
            f"{node.name}: average pool {p.text()} -> depthwise conv over {c} channels, "
            f"weights 1/{math.prod(p.kernel)}",
            dict(x=x, pool=p, channels=c, dtype=xi.dtype),
            record=dict(channels=c, kernel=list(p.kernel), stride=list(p.stride)),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        x, p, c, node = found["x"], found["pool"], found["channels"], found.nodes[0]
        device = next((t.device for t in gm.parameters()), torch.device("cpu"))
        weight = depthwise_mean(c, p, found["dtype"], device)
        if node.op == "call_module":
            conv = _CONV[p.rank](c, c, p.kernel, p.stride, p.padding, groups=c, bias=False)
            conv = conv.to(device=device, dtype=found["dtype"])
            conv.weight = nn.Parameter(weight)
            install_module(gm, node, conv, f"{node.target}_conv")
            return
        wn = new_const(gm, node, f"{node.name}_conv.weight", weight)
        fn = getattr(aten, f"conv{p.rank}d").default if is_aten(node) else _FUNC[p.rank]
        args = (x, wn, None, list(p.stride), list(p.padding), [1] * p.rank, c)
        replace_with(gm, node, fn, args)

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        node, p = found.nodes[0], found["pool"]
        c = node_cost(node)
        weight_bytes = found["channels"] * math.prod(p.kernel) * 4
        est = saving(target, [node], [NodeCost(c.flops, c.bytes + weight_bytes)])
        extra = -(est.time_saved_s or 0.0) * 1e6
        # no time saved, so that a lossy plan takes it for what it enables (training,
        # conv-only hardware) and the race keeps it only where it verifies and is faster
        return Estimate(
            est.flops_saved,
            est.bytes_saved,
            0.0,
            f"no speed-up: the same taps plus a weight per tap, {extra:.2f} us over the pool "
            "by the roofline; taken for a learnable pool",
        )
