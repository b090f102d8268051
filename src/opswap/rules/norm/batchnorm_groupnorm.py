"""norm.batchnorm_groupnorm: an eval BatchNorm (nn.BatchNorm*d, F.batch_norm, the aten
batch_norm overloads torch.export records) -> GroupNorm, its affine set from the running
statistics so that it starts near the BatchNorm's function. Lossy."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import copy_meta
from opswap.graph.shapes import dynamic_dims, info
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase, install_module, new_const
from opswap.rules._matching import input_of
from opswap.rules._weights import batch_norm
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.norm._bn_groupnorm import GROUPS, group_count, scale_shift, stats_init
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class BatchNormGroupNorm(Rule):
    """An inference BatchNorm -> GroupNorm over the same channels, with G the largest
    divisor of C up to 32, its affine a = s * sqrt(V + eps), b = s * M + t from the running
    statistics (M, V: the group's mixture mean and variance; s, t: the BatchNorm's scale
    and shift; rules/norm/_bn_groupnorm.py), which measured closer to the BatchNorm's
    outputs than gamma and beta, and than a least-squares fit on sample inputs. It
    ignores how a group's statistics move from sample to sample: that is the change of
    function, which opswap.train.norm_swap.distill trains away.

    Lossy: a GroupNorm normalises each sample with its own statistics, so its output is
    not the BatchNorm's; how far it lands is the verification's to say (0.23 relative L2
    of the logits on the digits net of tests/train/test_norm_swap.py before distilling).

    Where it pays: nowhere by speed. An eval BatchNorm folds into the conv before it for
    free (fusion.conv_bn, which runs after this rule and so loses these sites), or costs
    one read and one write; a GroupNorm reads its input twice (statistics, then apply) and
    writes once, and folds into nothing. It exists for the workflow that follows: training
    at batch 1-2, no train/eval discrepancy, runtimes without batch statistics. Its
    prediction saves no time (the roofline's extra cost is in the note and in the bytes),
    so that a plan at --exactness lossy can take it and the race decide: verification at
    the lossy tolerance, then the timing against the input, which keeps it only where it
    is faster; at exact and approx it is never considered.
    """

    name = "norm.batchnorm_groupnorm"
    family = "norm"
    chapter = 10
    exactness = "lossy"
    targets = ("cpu", "cuda")
    # a folded BatchNorm is gone: this rule must see them first; and its GroupNorm may
    # then go to the Triton kernel
    before = ("fusion.*", "norm.group_norm")
    relieves = ()
    anchors = ("batch_norm",)
    description = (
        "Eval BatchNorm -> GroupNorm (lossy; affine from the running statistics): per-sample "
        "statistics for small-batch training and runtimes without batch stats; no speed-up "
        "(a BatchNorm folds into its conv, a GroupNorm does not)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        x = input_of(node)
        if x is None:
            return None
        bn = batch_norm(gm, node)
        if isinstance(bn, str):
            return Refused(bn)
        xi = info(x)
        if xi is None or len(xi.shape) < 2:
            return Refused(f"{x.name} has no channel dim [N, C, ...] (or its shape is unknown)")
        if not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is {xi.dtype}; GroupNorm takes floating-point tensors")
        if 1 in dynamic_dims(x):
            return Refused(f"the channel count of {x.name} varies between calls")
        c = int(xi.shape[1])
        if bn.mean.numel() != c:
            return Refused(f"BatchNorm {node.name} has {bn.mean.numel()} channels, {x.name} {c}")
        g = group_count(c)
        if g == 1 and c > 1:
            return Refused(
                f"{c} channels have no divisor from 2 to {GROUPS}, so GroupNorm would be "
                "LayerNorm over all of them; opswap.train.norm_swap.prepare(model, to='layer') "
                "makes that choice on purpose"
            )
        spatial = [d for i, d in enumerate(xi.shape[2:], 2) if i not in dynamic_dims(x)]
        per_group = c // g
        for d in spatial:
            per_group *= int(d)
        if per_group == 1 and len(spatial) == len(xi.shape) - 2:
            return Refused(
                f"each of the {g} groups of {x.name} {list(xi.shape)} would hold one value, "
                "which GroupNorm always maps to 0"
            )
        s, t = scale_shift(bn.mean, bn.var, bn.eps, bn.weight, bn.bias, c)
        a, b = stats_init(bn.mean, bn.var, s, t, g, bn.eps)
        return Found(
            (node,),
            f"{node.name}: BatchNorm of {x.name} -> GroupNorm ({g} groups), affine from the "
            "running statistics",
            dict(x=x, bn=bn, groups=g, weight=a, bias=b, dtype=xi.dtype),
            record=dict(bn=node.name, groups=g),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, bn, g = found.nodes[0], found["bn"], found["groups"]
        like = bn.mean
        w = found["weight"].to(device=like.device, dtype=found["dtype"])
        b = found["bias"].to(device=like.device, dtype=found["dtype"])
        if node.op == "call_module":
            gn = nn.GroupNorm(g, w.numel(), eps=bn.eps, device=like.device, dtype=w.dtype)
            with torch.no_grad():
                gn.weight.copy_(w)
                gn.bias.copy_(b)
            install_module(gm, node, gn, f"{node.target}_groupnorm")
            return
        wn = new_const(gm, node, f"{node.name}_groupnorm_weight", w)
        bn_ = new_const(gm, node, f"{node.name}_groupnorm_bias", b)
        with gm.graph.inserting_before(node):
            new = call(gm.graph, node, "group_norm", (found["x"], g, wn, bn_, bn.eps))
        copy_meta(new, bn.out)
        bn.out.replace_all_uses_with(new)
        drop_dead_attrs(gm, erase(gm, [bn.out, *node.users, node]))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        node = found.nodes[0]
        own = node_cost(node)
        i = info(found["x"])
        n = i.numel if i is not None else 0
        nbytes = i.nbytes if i is not None else 0
        # statistics pass (read x) + apply pass (read x, write y); ~8 flops an element
        gn = NodeCost(max(own.flops, 8 * n), 3 * nbytes)
        est = saving(target, [node], [gn])
        extra = -(est.time_saved_s or 0.0) * 1e6
        return Estimate(
            est.flops_saved,
            est.bytes_saved,
            0.0,
            f"no speed-up: the roofline prices the GroupNorm {extra:.2f} us over this "
            "BatchNorm (which would fold into its conv for free); taken for per-sample "
            "normalisation, kept by the race only where it verifies and is faster",
        )
