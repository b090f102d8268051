"""norm.rms_norm: an RMSNorm, written out (HF's Llama/Qwen/Mistral/Gemma classes as
captured) or as nn.RMSNorm / F.rms_norm, -> `opswap::rms_norm`, one Triton kernel."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.ops import copy_meta
from opswap.rules import _triton
from opswap.rules._edits import drop_dead_attrs, erase
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.norm import _rms
from opswap.rules.registry import register
from opswap.targets.base import Target


def describe(rms: _rms.RMS) -> str:
    form = "cast, then weight" if rms.cast_first else "weight, then cast"
    w = "no weight" if rms.weight is None else ("1 + weight" if rms.offset else form)
    return f"RMSNorm of {rms.x.name} over {rms.hidden} ({len(rms.nodes)} ops, eps={rms.eps:g}, {w})"


def install(
    gm: fx.GraphModule,
    rms: _rms.RMS,
    residual: fx.Node | None = None,
    total: fx.Node | None = None,
) -> None:
    """Replace the pattern by the op: rms_norm, or add_rms_norm on (a, b) = residual's
    operands, whose sum takes over the other readers of `total` (the add, or a no-op
    cast of it)."""
    with gm.graph.inserting_before(rms.out):
        w = _rms.weight_arg(gm, rms, rms.out)
        args = (w, rms.eps, rms.offset, rms.cast_first)
        if residual is None:
            new = gm.graph.call_function(torch.ops.opswap.rms_norm.default, (rms.x, *args))
            y, s = new, None
        else:
            a, b = residual.args[:2]
            new = gm.graph.call_function(torch.ops.opswap.add_rms_norm.default, (a, b, *args))
            y = gm.graph.call_function(operator.getitem, (new, 0))
            s = gm.graph.call_function(operator.getitem, (new, 1))
            copy_meta(s, total if total is not None else residual)
    copy_meta(y, rms.out)
    rms.out.replace_all_uses_with(y)
    dead = erase(gm, rms.nodes)
    if residual is not None and s is not None:
        (total if total is not None else residual).replace_all_uses_with(s)
        dead += erase(gm, [n for n in (total, residual) if n is not None])
    drop_dead_attrs(gm, dead)


def estimate(
    gm: fx.GraphModule,
    rms: _rms.RMS,
    target: Target,
    kernel: str,
    removed: Sequence[fx.Node],
    residual: bool,
) -> Estimate:
    fused = NodeCost(4 * rms.rows * rms.hidden, _rms.fused_bytes(rms, residual))
    return _triton.predict(
        target,
        kernel,
        removed,
        fused,
        rms.dtype,
        rms.hidden,
        rms.rows,
        f"{len(list(removed))} kernels -> 1 at {rms.rows} x {rms.hidden}",
    )


@register
class RMSNormTriton(_triton.TritonRule):
    """RMSNorm as one Triton kernel that reads x once and writes y once, fp32 math inside
    whatever the input dtype. Exact: the kernel computes the pattern's own steps (upcast,
    mean of squares, rsqrt, the cast where the pattern casts, the weight where it
    multiplies) in fp32; only the order of the row's sum differs, which is rounding. A
    pattern without the upcast, computed in bfloat16 by eager, gets fp32 inside: fewer
    roundings, not another function."""

    name = "norm.rms_norm"
    family = "norm"
    chapter = 10
    relieves = ("memory:normalization", "memory:elementwise")
    anchors = ("rsqrt", "rms_norm")
    description = (
        "RMSNorm (HF's written-out form with or without the fp32 upcast, Gemma's 1 + weight, "
        "nn.RMSNorm, F.rms_norm) -> opswap::rms_norm: one Triton kernel, one read and one "
        "write of x (CUDA; forward and backward)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        rms = _rms.read(gm, node)
        if rms is None or isinstance(rms, str):
            return Refused(rms) if isinstance(rms, str) else None
        first = rms.nodes[0]
        return Found(
            rms.nodes,
            f"replace the {describe(rms)} by opswap::rms_norm",
            dict(rms=rms),
            key=f"{first.name}..{rms.out.name}",
            outputs=(rms.out,),
            record=dict(x=rms.x.name, out=rms.out.name, eps=rms.eps, offset=rms.offset),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        install(gm, found["rms"])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        rms = found["rms"]
        return estimate(gm, rms, target, "rms_norm", rms.nodes, residual=False)
