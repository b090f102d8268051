"""fusion.conv_relu: Conv (+ eval BatchNorm) + ReLU -> one conv with the ReLU in its epilogue."""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, copy_meta, op_kind
from opswap.rules._cost import saving
from opswap.rules._edits import drop_dead_attrs, erase, install_module, swap_in_module
from opswap.rules._matching import input_of, shared_reason
from opswap.rules._weights import BatchNormParts, Weighted, batch_norm, weighted, zero_padding
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.fusion._bn_fold import check_fold, fold
from opswap.rules.fusion._fused_conv_relu import FusedConvReLU
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class ConvReLU(Rule):
    """Conv (+ eval BatchNorm) + ReLU -> one convolution with the ReLU in its epilogue.

    It runs after conv_bn (declared below), so the BatchNorms are folded first and
    this rule sees Conv -> ReLU; it also takes Conv -> BN -> ReLU itself (folding
    the BN) when run without conv_bn. The installed
    FusedConvReLU runs oneDNN's conv with a fused ReLU post-op on CPU (float32, the
    weight reordered once) and cuDNN's conv+ReLU on CUDA; it falls back to
    conv + in-place ReLU elsewhere. Saved: the write of the conv output and its
    re-read by the ReLU (plus the BatchNorm's, when folded here).
    """

    name = "fusion.conv_relu"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    targets = ("cpu", "cuda")
    # conv_bn refuses a conv that already has a fused ReLU: it must fold first
    after = ("fusion.conv_bn",)
    relieves = ("memory:elementwise", "memory:activation")
    description = (
        "Conv (+ eval BatchNorm, folded) + ReLU -> FusedConvReLU: the ReLU is applied "
        "in the conv's epilogue (oneDNN on CPU, cuDNN on CUDA), so the conv output "
        "is never written and re-read."
    )

    anchors = ("relu",)

    def check(self, gm: fx.GraphModule, relu: fx.Node) -> Found | Refused | None:
        prev = input_of(relu)
        if prev is None:
            return None
        bn = prev if op_kind(prev) == "batch_norm" else None
        conv = input_of(bn) if bn is not None else prev
        if conv is None or op_kind(conv) not in ("conv", "conv_transpose"):
            return None
        if op_kind(conv) == "conv_transpose":
            return Refused(
                f"{conv.name} is a transposed convolution; there is no fused ReLU kernel for it"
            )
        w: Weighted | str
        if bn is not None:
            checked = check_fold(gm, conv, bn, conv.name)
            if isinstance(checked, str):
                return Refused(checked)
            w = checked[0]
            shared = shared_reason(bn, {relu}, "the ReLU cannot be fused into the conv")
        else:
            w = weighted(gm, conv)
            if isinstance(w, str):
                return Refused(w)
            shared = shared_reason(conv, {relu}, "the ReLU cannot be fused into it")
        if shared:
            return Refused(shared)
        if w.transposed:
            return Refused(
                f"{conv.name} is a transposed convolution; there is no fused ReLU kernel for it"
            )
        padding = zero_padding(w, conv)
        if isinstance(padding, str):
            return Refused(padding)
        chain = (conv, bn, relu) if bn is not None else (conv, relu)
        what = (
            f"{conv.name} + BatchNorm {bn.name} + {relu.name}"
            if bn is not None
            else f"{conv.name} + {relu.name}"
        )
        return Found(
            chain,
            f"fuse {what} into one conv with a ReLU epilogue",
            dict(conv=conv, bn=bn, w=w, padding=padding),
            record=dict(conv=conv.name, bn=bn.name if bn is not None else None, relu=relu.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        conv, bn, w, padding = found["conv"], found["bn"], found["w"], found["padding"]
        relu = found.nodes[-1]
        bias: torch.Tensor | None
        if bn is not None:
            # check read this BatchNorm's parts, so they are still there
            weight, bias = fold(w, cast(BatchNormParts, batch_norm(gm, bn)))
        else:
            weight = w.weight.detach().clone()
            bias = None if w.bias is None else w.bias.detach().clone()
        grad = w.weight.requires_grad
        fused = FusedConvReLU(weight, bias, w.stride, padding, w.dilation, w.groups, grad)
        if conv.op == "call_module":
            new = install_module(gm, conv, fused, str(conv.target))
        else:
            # function flavour: the fused module takes the name of the weights' container
            # ('conv' for 'conv.weight') once nothing else reads it
            removed = [relu, bn, conv] if bn is not None else [relu, conv]
            swap_in_module(
                gm,
                fused,
                (input_of(conv),),
                relu,
                removed,
                f"{conv.name}_relu",
                home=arg(conv, 1, "weight"),
            )
            return
        relu.replace_all_uses_with(new)
        copy_meta(new, relu)
        drop_dead_attrs(gm, erase(gm, [relu, bn] if bn is not None else [relu]))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        relu, bn = found.nodes[-1], found["bn"]
        # the max(0, x) still runs, in the conv's epilogue, but moves no bytes
        epilogue = NodeCost(node_cost(relu).flops, 0)
        removed = [bn, relu] if bn is not None else [relu]
        return saving(
            target,
            removed,
            [epilogue],
            "ReLU in the conv epilogue"
            + (" and BatchNorm folded" if bn else "")
            + ": the conv output is written once, never re-read",
        )
