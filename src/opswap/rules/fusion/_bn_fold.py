"""Folding an inference BatchNorm into the conv or linear before it: shared by
fusion.conv_bn, fusion.linear_bn and fusion.conv_relu (which folds one itself when
it runs without conv_bn)."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.graph.ops import op_kind
from opswap.rules._cost import saving
from opswap.rules._edits import drop_dead_attrs, erase, replace_weights
from opswap.rules._matching import input_of, shared_reason
from opswap.rules._weights import BatchNormParts, Weighted, batch_norm, fold_affine, weighted
from opswap.rules.base import Estimate, Miss, Rule, Site, node_by_name


def fold(w: Weighted, bn: BatchNormParts) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of `w` followed by `bn`."""
    weight, bias = fold_affine(w, *bn.scale_shift())
    return weight, bias


def check_fold(gm: fx.GraphModule, src: fx.Node, bn_node: fx.Node,
               what: str) -> tuple[Weighted, BatchNormParts] | str:
    """(Weighted, BatchNormParts) for `src` -> `bn_node`, or the reason they do not fold."""
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


def bn_saving(gm, site: Site, target, note: str) -> Estimate:
    bn = node_by_name(gm, site.data["bn"])
    return saving(target, [bn] if bn is not None else [], note=note)


def fold_into(gm: fx.GraphModule, src: fx.Node, bn_node: fx.Node) -> None:
    w, bn = check_fold(gm, src, bn_node, src.name)
    weight, bias = fold(w, bn)
    new = replace_weights(gm, w, weight, bias)
    bn.out.replace_all_uses_with(new)
    dead = erase(gm, [bn.out, *bn_node.users, bn_node])
    drop_dead_attrs(gm, dead)


def bn_fold_sites(rule: Rule, gm: fx.GraphModule, kinds: tuple[str, ...], role: str,
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
            checked = check_fold(gm, src, node, src.name)
            reason = checked if isinstance(checked, str) else None
        if reason is not None:
            found.append(rule.miss(node, reason))
            continue
        found.append(rule.site(f"{src.name}+{node.name}", [src, node],
                               f"fold BatchNorm {node.name} into {src.name}",
                               **{role: src.name, "bn": node.name}))
    return found
