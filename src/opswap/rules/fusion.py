"""Chapter 4: fusion. Ops that write a tensor only for the next op to read it back.

Each rule here removes an intermediate tensor's round trip through memory,
either by folding a constant transform into a neighbour's weights at rewrite
time (BatchNorm into conv / linear: the BN disappears), or by replacing a chain
of small ops with one kernel that keeps the intermediate in registers (Conv +
ReLU, MatMul + Add, the hand-written LayerNorm, log(softmax)), or by reading a
shared input once instead of k times (parallel Linears). All are exact: the
result differs from the original only by float rounding.

Order matters and is by name within the chapter: conv_bn folds every foldable
BatchNorm first, so conv_relu then sees Conv -> ReLU and fuses the activation
(it also folds a BN itself when run alone); matmul_add runs before
parallel_linear, so an `x @ W + b` that became a linear can merge with siblings.

The matchers for LayerNorm and for the two linear rules live in
`_fusion_layer_norm.py` and `_fusion_linear.py`; this module registers them all.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, copy_meta, is_aten, module_of, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules._access import (
    BatchNormParts,
    Weighted,
    batch_norm,
    input_of,
    shared_reason,
    weighted,
)
from opswap.rules._fusion_cost import saving
from opswap.rules._fusion_edit import (
    drop_dead_attrs,
    erase,
    install_module,
    replace_weights,
    swap_in_module,
)
from opswap.rules._fusion_modules import FusedConvReLU
from opswap.rules.base import Estimate, Miss, Rule, Site, node_by_name
from opswap.rules.registry import register

aten = torch.ops.aten


def _fold(w: Weighted, bn: BatchNormParts) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of `w` followed by `bn`, computed in float64 and cast back, so
    the fold itself adds no more than one rounding per weight."""
    scale, shift = bn.scale_shift()
    weight = w.weight.detach().double()
    if w.transposed:
        # weight: [C_in, C_out / groups, *k]; output channel = group * (C_out/groups) + j
        g = w.groups
        grouped = weight.reshape(g, weight.shape[0] // g, *weight.shape[1:])
        weight = (grouped * scale.reshape(g, 1, -1, *[1] * (weight.dim() - 2))).reshape(weight.shape)
    else:
        weight = weight * scale.reshape(-1, *[1] * (weight.dim() - 1))
    bias = torch.zeros_like(shift) if w.bias is None else w.bias.detach().double()
    bias_dtype = w.weight.dtype if w.bias is None else w.bias.dtype
    return weight.to(w.weight.dtype).contiguous(), (bias * scale + shift).to(bias_dtype)


def _check_fold(gm: fx.GraphModule, src: fx.Node, bn_node: fx.Node, what: str):
    """(Weighted, BatchNormParts) for `src` -> `bn_node`, or a reason string."""
    bn = batch_norm(gm, bn_node)
    if isinstance(bn, str):
        return bn
    w = weighted(gm, src)
    if isinstance(w, str):
        return w
    shared = shared_reason(src, {bn_node}, f"the BatchNorm cannot be folded into {what}")
    if shared:
        return shared
    if not w.weight.is_floating_point():
        return f"{src.name}'s weight is {w.weight.dtype}, not a floating-point type"
    if bn.mean.numel() != w.out_channels:
        return (f"BatchNorm {bn_node.name} has {bn.mean.numel()} channels but {src.name} "
                f"produces {w.out_channels}")
    return w, bn


def _bn_saving(gm, site: Site, target, note: str) -> Estimate:
    bn = node_by_name(gm, site.data["bn"])
    return saving(target, [bn] if bn is not None else [], note=note)


def _fold_into(gm: fx.GraphModule, src: fx.Node, bn_node: fx.Node) -> None:
    w, bn = _check_fold(gm, src, bn_node, src.name)
    weight, bias = _fold(w, bn)
    new = replace_weights(gm, w, weight, bias)
    bn.out.replace_all_uses_with(new)
    dead = erase(gm, [bn.out, *bn_node.users, bn_node])
    drop_dead_attrs(gm, dead)


def _linear_output_is_2d(src: fx.Node, bn: fx.Node) -> str | None:
    shape = info(src).shape if info(src) is not None else None
    if shape is None:
        return f"the shape of {src.name}'s output is unknown"
    if len(shape) != 2:
        return (f"{src.name}'s output is {len(shape)}-D: BatchNorm {bn.name} normalises "
                "dim 1, not the Linear's output features (the last dim)")
    return None


def _bn_fold_sites(rule: Rule, gm: fx.GraphModule, kinds: tuple[str, ...], role: str,
                   check=None) -> list[Site | Miss]:
    """Sites where an eval BatchNorm directly follows an op of `kinds` and can be folded
    into its weights; `check(src, bn)` may add a refusal of its own."""
    found: list[Site | Miss] = []
    for node in gm.graph.nodes:
        if op_kind(node) != "batch_norm":
            continue
        src = input_of(node)
        if src is None or op_kind(src) not in kinds:
            continue
        reason = check(src, node) if check is not None else None
        if reason is None:
            checked = _check_fold(gm, src, node, src.name)
            reason = checked if isinstance(checked, str) else None
        if reason is not None:
            found.append(rule.miss(node, reason))
            continue
        found.append(rule.site(f"{src.name}+{node.name}", [src, node],
                               f"fold BatchNorm {node.name} into {src.name}",
                               **{role: src.name, "bn": node.name}))
    return found


@register
class ConvBatchNorm(Rule):
    """Fold an inference BatchNorm into the convolution before it.

    In eval mode BatchNorm is a per-channel affine map, y = x * s + t, so it can
    be multiplied into the conv's weight (w * s per output channel) and bias
    (b * s + t). The BN kernel, and with it a full write and re-read of the conv
    output, disappears. Also handles transposed convolutions.
    """

    name = "fusion.conv_bn"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    targets = ("any",)
    description = ("Conv (1d/2d/3d, also transposed) + eval BatchNorm -> one conv with the BN "
                   "folded into its weight and bias; saves the BN's read and write of the conv "
                   "output.")

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        return _bn_fold_sites(self, gm, ("conv", "conv_transpose"), "conv")

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        _fold_into(gm, node_by_name(gm, site.data["conv"]), node_by_name(gm, site.data["bn"]))

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        return _bn_saving(gm, site, target, "BatchNorm folded into the conv weights: one "
                          "read and one write of the conv output saved")


@register
class LinearBatchNorm(Rule):
    """Fold an inference BatchNorm1d on a Linear's [N, C] output into the Linear.

    Same algebra as conv_bn, with the output features as channels. Only a 2-D
    output qualifies: BatchNorm1d on [N, C, L] normalises dim 1, which is not a
    Linear's feature dim (the last one).
    """

    name = "fusion.linear_bn"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    description = ("Linear + eval BatchNorm1d on [N, C] -> one Linear with the BN folded in; "
                   "saves the BN's read and write of the Linear output.")

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        return _bn_fold_sites(self, gm, ("linear",), "linear", _linear_output_is_2d)

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        _fold_into(gm, node_by_name(gm, site.data["linear"]), node_by_name(gm, site.data["bn"]))

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        return _bn_saving(gm, site, target, "BatchNorm folded into the Linear weights: one "
                          "read and one write of the Linear output saved")


def _zero_padding(w: Weighted, conv: fx.Node) -> tuple[int, ...] | str:
    """Explicit symmetric zero padding of a conv, or why it has none."""
    if w.padding_mode != "zeros":
        return (f"{conv.name} pads with padding_mode={w.padding_mode!r}; the fused kernel "
                "pads with zeros only")
    if not isinstance(w.padding, str):
        return tuple(w.padding)
    if w.padding == "valid":
        return (0,) * (w.weight.dim() - 2)
    total = [d * (k - 1) for d, k in zip(w.dilation, w.weight.shape[2:], strict=True)]
    if any(t % 2 for t in total):
        return (f"{conv.name} uses padding='same' with an even kernel, which pads unevenly; "
                "the fused kernel pads both sides equally")
    return tuple(t // 2 for t in total)


@register
class ConvReLU(Rule):
    """Conv (+ eval BatchNorm) + ReLU -> one convolution with the ReLU in its epilogue.

    Why this name and not conv_bn_relu: rules run in name order, so conv_bn folds
    the BatchNorms first and this rule then sees Conv -> ReLU. It also takes Conv ->
    BN -> ReLU itself (folding the BN) when run without conv_bn. The installed
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
    description = ("Conv (+ eval BatchNorm, folded) + ReLU -> FusedConvReLU: the ReLU is applied "
                   "in the conv's epilogue (oneDNN on CPU, cuDNN on CUDA), so the conv output "
                   "is never written and re-read.")

    def _check(self, gm: fx.GraphModule, relu: fx.Node):
        """(conv, bn or None, Weighted, padding) or a reason; None when not a near-match."""
        prev = input_of(relu)
        if prev is None:
            return None
        bn = prev if op_kind(prev) == "batch_norm" else None
        conv = input_of(bn) if bn is not None else prev
        if conv is None or op_kind(conv) not in ("conv", "conv_transpose"):
            return None
        if op_kind(conv) == "conv_transpose":
            return f"{conv.name} is a transposed convolution; there is no fused ReLU kernel for it"
        if bn is not None:
            checked = _check_fold(gm, conv, bn, conv.name)
            if isinstance(checked, str):
                return checked
            w = checked[0]
            shared = shared_reason(bn, {relu}, "the ReLU cannot be fused into the conv")
        else:
            w = weighted(gm, conv)
            if isinstance(w, str):
                return w
            shared = shared_reason(conv, {relu}, "the ReLU cannot be fused into it")
        if shared:
            return shared
        if w.transposed:
            return f"{conv.name} is a transposed convolution; there is no fused ReLU kernel for it"
        padding = _zero_padding(w, conv)
        if isinstance(padding, str):
            return padding
        return conv, bn, w, padding

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        found: list[Site | Miss] = []
        for node in gm.graph.nodes:
            if op_kind(node) != "relu":
                continue
            checked = self._check(gm, node)
            if checked is None:
                continue
            if isinstance(checked, str):
                found.append(self.miss(node, checked))
                continue
            conv, bn, _, _ = checked
            chain = [conv, bn, node] if bn is not None else [conv, node]
            what = f"{conv.name} + BatchNorm {bn.name} + {node.name}" if bn is not None \
                else f"{conv.name} + {node.name}"
            found.append(self.site("+".join(n.name for n in chain), chain,
                                   f"fuse {what} into one conv with a ReLU epilogue",
                                   conv=conv.name, bn=bn.name if bn is not None else None,
                                   relu=node.name))
        return found

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        relu = node_by_name(gm, site.data["relu"])
        conv, bn, w, padding = self._check(gm, relu)
        if bn is not None:
            weight, bias = _fold(w, batch_norm(gm, bn))
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
            swap_in_module(gm, fused, (input_of(conv),), relu, removed, f"{conv.name}_relu",
                           home=arg(conv, 1, "weight"))
            return
        relu.replace_all_uses_with(new)
        copy_meta(new, relu)
        drop_dead_attrs(gm, erase(gm, [relu, bn] if bn is not None else [relu]))

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        relu = node_by_name(gm, site.data["relu"])
        bn = node_by_name(gm, site.data["bn"]) if site.data.get("bn") else None
        # the max(0, x) still runs, in the conv's epilogue, but moves no bytes
        epilogue = NodeCost(node_cost(relu).flops, 0)
        removed = [bn, relu] if bn is not None else [relu]
        return saving(target, removed, [epilogue],
                      "ReLU in the conv epilogue" + (" and BatchNorm folded" if bn else "")
                      + ": the conv output is written once, never re-read")


# --------------------------------------------------------------------------- log(softmax)


def _softmax_dim(gm: fx.GraphModule, sm: fx.Node):
    """(dim, dtype or None, half_to_float) of a softmax node, or a reason string."""
    if sm.op == "call_module":
        dim = getattr(module_of(sm), "dim", None)
        dtype, half = None, False
    elif raw_name(sm) == "_safe_softmax":
        return (f"{sm.name} is a masked (_safe_softmax) softmax, which returns 0 on fully "
                "masked rows where log_softmax would return NaN")
    elif raw_name(sm) == "_softmax":
        dim, dtype, half = arg(sm, 1, "dim"), None, bool(arg(sm, 2, "half_to_float", False))
    else:
        dtype_at = 3 if sm.target is F.softmax else 2  # F.softmax(x, dim, _stacklevel, dtype)
        dim, dtype, half = arg(sm, 1, "dim"), arg(sm, dtype_at, "dtype"), False
    if dim is None:
        return (f"{sm.name} is a softmax with an implicit dim (deprecated), so the dim "
                "log_softmax should use is not known")
    if not isinstance(dim, int) or isinstance(dtype, fx.Node):
        return f"the dim of {sm.name} is computed at run time"
    return dim, dtype, half


@register
class LogSoftmax(Rule):
    """log(softmax(x, dim)) -> log_softmax(x, dim).

    One kernel instead of two (the softmax output is no longer written and read
    back), and more accurate: log_softmax computes x - max - log(sum(exp(x - max)))
    directly, where log(softmax(x)) rounds tiny probabilities to 0 and returns -inf.
    When the softmax output is also read elsewhere, the softmax stays for those
    readers and only the log is replaced (same traffic, better accuracy).
    """

    name = "fusion.log_softmax"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    description = ("log(softmax(x, dim)) -> log_softmax(x, dim): one kernel instead of two "
                   "(the probabilities are not written and re-read) and numerically more "
                   "stable (no log(0) = -inf for tiny probabilities).")

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        found: list[Site | Miss] = []
        for node in gm.graph.nodes:
            if op_kind(node) != "log" or raw_name(node) != "log":  # not log_: it writes in place
                continue
            sm = input_of(node)
            if sm is None or op_kind(sm) != "softmax":
                continue
            checked = _softmax_dim(gm, sm)
            if isinstance(checked, str):
                found.append(self.miss(node, checked))
                continue
            shared = [u.name for u in sm.users if u is not node]
            nodes = [node] if shared else [sm, node]
            desc = f"replace log({sm.name}) by log_softmax"
            if shared:
                desc += f" ({sm.name} stays: {', '.join(shared[:3])} also read it)"
            found.append(self.site(f"{sm.name}+{node.name}", nodes, desc, softmax=sm.name,
                                   log=node.name, shared=bool(shared)))
        return found

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        log = node_by_name(gm, site.data["log"])
        sm = input_of(log)
        dim, dtype, half = _softmax_dim(gm, sm)
        x = input_of(sm)
        with gm.graph.inserting_before(log):
            if sm.op == "call_module" or not is_aten(sm):
                kwargs = {"dtype": dtype} if dtype is not None else {}
                new = gm.graph.call_function(torch.log_softmax, (x, dim), kwargs)
            elif raw_name(sm) == "_softmax":
                new = gm.graph.call_function(aten._log_softmax.default, (x, dim, half))
            else:
                args = (x, dim, dtype) if dtype is not None else (x, dim)
                new = gm.graph.call_function(aten.log_softmax.int, args)
        copy_meta(new, log)
        log.replace_all_uses_with(new)
        erase(gm, [log, sm])

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        log, sm = node_by_name(gm, site.data["log"]), node_by_name(gm, site.data["softmax"])
        c_sm, c_log = node_cost(sm), node_cost(log)
        # log_softmax reads x and writes the result: the bytes of the log alone
        fused = NodeCost(c_sm.flops + c_log.flops, c_log.bytes)
        removed = [log] if site.data.get("shared") else [sm, log]
        note = ("softmax kept for its other readers; the log becomes log_softmax"
                if site.data.get("shared") else "softmax probabilities no longer written and re-read")
        return saving(target, removed, [fused], note)


# The remaining rules register themselves on import.
from opswap.rules._fusion_layer_norm import LayerNormFusion  # noqa: E402
from opswap.rules._fusion_linear import MatMulAdd, ParallelLinear  # noqa: E402

__all__ = ["ConvBatchNorm", "ConvReLU", "FusedConvReLU", "LayerNormFusion", "LinearBatchNorm",
           "LogSoftmax", "MatMulAdd", "ParallelLinear"]
