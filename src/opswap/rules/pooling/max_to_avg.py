"""pooling.max_to_avg: MaxPool -> AvgPool of the same kernel, stride and padding. Lossy.

Why: an average pool is linear, so it folds into a neighbouring conv or Linear, runs on
accelerators and runtimes that lack a max pool or its int8 form, and passes a gradient
to every input of its window (the reason some architectures prefer it for training).
It is not the same function: the average of a window is not its largest value, so the
model's accuracy moves; opswap.train.finetune_pooling measures by how much on the digits
task and fine-tunes it back. A max pool's padding never wins the max (it pads with
-inf), so the average leaves padding out of the count too (count_include_pad=False),
which keeps border windows on the scale of the inside ones.

Where it pays by speed: by the roofline, nowhere (both read each input once and write
the output once), so its prediction saves nothing and the race decides. On the CPU the
race often keeps it: PyTorch's CPU max pool is slow, MaxPool2d(3, 2, 1) on 1 x 64 x 56 x
56 took 1.16 ms and the average pool 0.34 ms (torch 2.13, one thread,
benchmarks/bench_pooling.py).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import copy_meta, op_kind
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase, install_module
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.pooling._pool import Pool, read
from opswap.rules.registry import register

_AVG: dict[int, type[nn.Module]] = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}


@register
class MaxToAvg(Rule):
    """MaxPool{1,2,3}d -> AvgPool{1,2,3}d with the same kernel, stride, padding and
    ceil_mode, padding left out of each window's count."""

    name = "pooling.max_to_avg"
    family = "pooling"
    chapter = 13
    exactness = "lossy"
    relieves = ()
    anchors = ("max_pool",)
    before = ("pooling.strided_conv",)
    description = (
        "MaxPool -> AvgPool of the same kernel/stride/padding (lossy: fine-tune after it, "
        "opswap.train.finetune_pooling): a linear pool that folds into convs and runs where "
        "a max pool does not."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        got = read(node)
        if not isinstance(got, tuple):
            return got
        x, p = got
        out = node
        if p.return_indices:
            users = list(node.users)
            if any(op_kind(u) != "slice" or u.args[1:] != (0,) for u in users) or len(users) != 1:
                return Refused(
                    f"{node.name} returns the indices of its maxima, which an average pool has "
                    "no answer for"
                )
            out = users[0]
        if any(d != 1 for d in p.dilation):
            return Refused(
                f"{node.name} has dilation {p.dilation}, and an average pool has no dilation"
            )
        xi = info(x)
        if xi is not None and not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is {xi.dtype}; an average pool takes floating-point tensors")
        nodes = (node,) if out is node else (node, out)
        return Found(
            nodes,
            f"{node.name}: max pool {p.text()} -> average pool (padding not counted)",
            dict(x=x, pool=p),
            record=dict(kernel=list(p.kernel), stride=list(p.stride)),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        x, p = found["x"], found["pool"]
        node, out = found.nodes[0], found.nodes[-1]
        assert isinstance(p, Pool)
        if node.op == "call_module" and out is node:
            avg = _AVG[p.rank](
                p.kernel, p.stride, p.padding, ceil_mode=p.ceil_mode, count_include_pad=False
            )
            install_module(gm, node, avg, f"{node.target}_avg")
            return
        args = (x, list(p.kernel), list(p.stride), list(p.padding), p.ceil_mode, False)
        with gm.graph.inserting_before(out):
            new = call(gm.graph, node, f"avg_pool{p.rank}d", args)
        copy_meta(new, out)
        out.replace_all_uses_with(new)
        drop_dead_attrs(gm, erase(gm, list(found.nodes)))

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        c = node_cost(found.nodes[0])
        est = saving(target, found.nodes[:1], [NodeCost(c.flops, c.bytes)])
        note = "no speed-up by itself (same reads and writes): a linear pool, for what it enables"
        return Estimate(est.flops_saved, est.bytes_saved, 0.0, note)
