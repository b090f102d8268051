"""Folding an inference BatchNorm into the conv or linear before it: shared by
fusion.conv_bn, fusion.linear_bn and fusion.conv_relu (which folds one itself when
it runs without conv_bn)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.fx as fx

from opswap.graph.ops import op_kind
from opswap.rules._cost import saving
from opswap.rules._edits import drop_dead_attrs, erase, replace_weights
from opswap.rules._matching import input_of, shared_reason
from opswap.rules._weights import BatchNormParts, Weighted, batch_norm, fold_affine, weighted
from opswap.rules.base import Estimate, Found, Refused
from opswap.targets.base import Target


def fold(w: Weighted, bn: BatchNormParts) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of `w` followed by `bn`."""
    weight, bias = fold_affine(w, *bn.scale_shift())
    return weight, cast(torch.Tensor, bias)  # a BatchNorm always has a shift, so a bias


def check_fold(
    gm: fx.GraphModule, src: fx.Node, bn_node: fx.Node, what: str
) -> tuple[Weighted, BatchNormParts] | str:
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
        return (
            f"BatchNorm {bn_node.name} has {bn.mean.numel()} channels but {src.name} "
            f"produces {w.out_channels}"
        )
    return w, bn


def bn_saving(target: Target, found: Found, note: str) -> Estimate:
    return saving(target, [found["bn_node"]], note=note)


def fold_into(gm: fx.GraphModule, found: Found) -> None:
    """Fold the BatchNorm of a Found from `bn_fold_check` into the op before it."""
    w, bn = found["w"], found["bn"]
    weight, bias = fold(w, bn)
    new = replace_weights(gm, w, weight, bias)
    bn.out.replace_all_uses_with(new)
    bn_node = found["bn_node"]
    dead = erase(gm, [bn.out, *bn_node.users, bn_node])
    drop_dead_attrs(gm, dead)


def bn_fold_check(
    gm: fx.GraphModule,
    node: fx.Node,
    kinds: tuple[str, ...],
    role: str,
    check: Callable[[fx.Node, fx.Node], str | None] | None = None,
) -> Found | Refused | None:
    """At a BatchNorm `node` that directly follows an op of `kinds`: the fold, or why not;
    `check(src, bn)` may add a refusal of its own."""
    src = input_of(node)
    if src is None or op_kind(src) not in kinds:
        return None
    reason = check(src, node) if check is not None else None
    if reason is not None:
        return Refused(reason)
    checked = check_fold(gm, src, node, src.name)
    if isinstance(checked, str):
        return Refused(checked)
    w, bn = checked
    return Found(
        (src, node),
        f"fold BatchNorm {node.name} into {src.name}",
        dict(w=w, bn=bn, bn_node=node),
        record={role: src.name, "bn": node.name},
    )
