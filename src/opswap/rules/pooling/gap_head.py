"""pooling.gap_head: flatten + Linear over a C x H x W feature map -> global average
pooling + a Linear from C. Lossy.

A classifier head that flattens its last feature map into a C*H*W vector carries a weight
of C*H*W x out (VGG: 25088 x 4096, 103M parameters, most of the network); global average
pooling (Network in Network, ResNet) keeps C x out. The new weight starts from the old:
W'[o, c] = sum over (h, w) of W[o, c, h, w], which gives the original output exactly when
every channel is constant over the map (the mean times H*W per tap), and is the least
change otherwise. Spatial detail the old head read is gone, so accuracy moves; fine-tune
after it (opswap.train.finetune_pooling) to win it back. The new head also takes maps of
any size, where the old one took only H x W.

Where it pays: the head's GEMM shrinks by H*W (and its weight with it); measured in
benchmarks/bench_pooling.py. A tiny map (2 x 2) saves little.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.cost import NodeCost
from opswap.graph.ops import copy_meta, is_aten, op_kind
from opswap.graph.shapes import dynamic_dims, info
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase, fresh_path, new_const
from opswap.rules._matching import input_of, setting
from opswap.rules._weights import weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register

aten = torch.ops.aten


def head_weight(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """[out, C*H*W] -> [out, C]: each channel's taps summed over the map."""
    return weight.reshape(weight.shape[0], channels, -1).sum(-1)


@register
class GapHead(Rule):
    """linear(flatten(x, 1)) on x [N, C, *spatial] -> linear(x.mean(spatial), W') with
    W' the weight summed over each channel's positions."""

    name = "pooling.gap_head"
    family = "pooling"
    chapter = 13
    exactness = "lossy"
    relieves = ("memory:matmul", "compute:matmul")
    anchors = ("linear",)
    description = (
        "flatten + Linear on a C x H x W map -> global average pool + Linear(C -> out), "
        "its weight summed over H x W (lossy: fine-tune after it); a head H*W times smaller."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        flat = input_of(node)
        if flat is None or op_kind(flat) != "flatten":
            return None
        x = input_of(flat)
        xi = info(x) if x is not None else None
        if x is None or xi is None or len(xi.shape) < 3:
            return None
        if setting(flat, "start_dim", 0) != 1 or setting(flat, "end_dim", -1) not in (
            -1,
            len(xi.shape) - 1,
        ):
            return None
        w = weighted(gm, node)
        if isinstance(w, str):
            return Refused(w)
        if dynamic_dims(x) & set(range(1, len(xi.shape))):
            return Refused(f"the channels or map size of {x.name} vary between calls")
        c = int(xi.shape[1])
        if w.weight.shape[1] != math.prod(xi.shape[1:]):
            return Refused(f"{node.name} reads {w.weight.shape[1]} features, not {x.name}'s")
        if math.prod(xi.shape[2:]) == 1:
            return Refused(f"{x.name}'s map is 1 x 1 already: its flatten is a global pool")
        spatial = "x".join(str(s) for s in xi.shape[2:])
        return Found(
            (flat, node),
            f"{flat.name} + {node.name}: flatten of {c} x {spatial} + Linear -> global "
            f"average pool + Linear({c} -> {w.weight.shape[0]})",
            dict(x=x, w=w, channels=c, dims=list(range(2, len(xi.shape)))),
            record=dict(channels=c, map=list(xi.shape[2:])),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        x, w, c = found["x"], found["w"], found["channels"]
        flat, node = found.nodes
        weight = head_weight(w.weight.detach(), c)
        bias = None if w.bias is None else w.bias.detach().clone()
        graph = gm.graph
        with graph.inserting_before(node):
            pooled = call(graph, flat, "mean.dim", (x, found["dims"], False))
        if node.op == "call_module":
            lin = nn.Linear(c, weight.shape[0], bias=bias is not None)
            lin = lin.to(device=weight.device, dtype=weight.dtype)
            lin.weight = nn.Parameter(weight)
            if bias is not None:
                lin.bias = nn.Parameter(bias)
            target = fresh_path(gm, f"{node.target}_gap")
            gm.add_submodule(target, lin)
            with graph.inserting_before(node):
                head = graph.call_module(target, (pooled,))
        else:
            wn = new_const(gm, pooled, f"{node.name}_gap.weight", weight)
            args: tuple[Any, ...] = (pooled, wn)
            if bias is not None:
                args += (new_const(gm, pooled, f"{node.name}_gap.bias", bias),)
            fn = aten.linear.default if is_aten(node) else F.linear
            with graph.inserting_before(node):
                head = graph.call_function(fn, args)
        copy_meta(head, node)
        node.replace_all_uses_with(head)
        drop_dead_attrs(gm, erase(gm, [node, flat]))
        if node.op == "call_module" and not any(
            n.op == "call_module" and n.target == node.target for n in graph.nodes
        ):
            parent, _, leaf = str(node.target).rpartition(".")
            delattr(gm.get_submodule(parent) if parent else gm, leaf)

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        x, w, c = found["x"], found["w"], found["channels"]
        flat, node = found.nodes
        xi = info(x)
        assert xi is not None
        n, out = xi.shape[0], w.weight.shape[0]
        item = w.weight.element_size()
        mean = NodeCost(xi.numel, xi.nbytes + n * c * item)
        head = NodeCost(2 * n * c * out, (n * c + c * out + n * out) * item)
        return saving(target, [flat, node], [mean, head], f"head weight / {xi.numel // (n * c)}")
