"""softmax.softmax: softmax and log_softmax over the last dim (the op, or the safe
softmax written by hand: exp(x - max) / sum), with the scale and the additive or boolean
mask that feed it (attention's `scores * scale + mask`) -> `opswap::softmax`,
`opswap::log_softmax` or `opswap::masked_softmax`: one Triton kernel."""

from __future__ import annotations

import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.ops import op_kind
from opswap.rules import _triton
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.registry import register
from opswap.rules.softmax import _read
from opswap.targets.base import Target


def kernel_name(sm: _read.Softmax) -> str:
    if sm.mask is not None or sm.scale != 1.0:
        return "masked_softmax"
    return "log_softmax" if sm.log else "softmax"


def found(sm: _read.Softmax, rule: str) -> Found:
    what = "log_softmax" if sm.log else "softmax"
    extra = []
    if sm.scale != 1.0:
        extra.append(f"scale {sm.scale:g}")
    if sm.mask is not None:
        extra.append(f"mask {sm.mask.name}")
    desc = (
        f"{what} of {sm.x.name} over {sm.hidden} ({sm.form}"
        + (", " + ", ".join(extra) if extra else "")
        + f") -> opswap::{kernel_name(sm)}"
    )
    return Found(
        sm.nodes,
        desc,
        dict(sm=sm),
        key=f"{sm.nodes[0].name}..{sm.nodes[-1].name}",
        record=dict(x=sm.x.name, out=sm.nodes[-1].name, kernel=kernel_name(sm), form=sm.form),
    )


def estimate(sm: _read.Softmax, target: Target) -> Estimate:
    fused = NodeCost(5 * sm.rows * sm.hidden, _read.fused_bytes(sm))
    return _triton.predict(
        target,
        kernel_name(sm),
        sm.nodes,
        fused,
        sm.in_dtype,
        sm.hidden,
        sm.rows,
        f"{len(sm.nodes)} ops -> 1 at {sm.rows} x {sm.hidden}",
    )


@register
class SoftmaxTriton(_triton.TritonRule):
    """Softmax as one Triton kernel with fp32 math. Exact: the kernel computes the safe
    softmax (max subtracted) that torch.softmax computes, the scale and mask in fp32 where
    eager rounds scores * scale and + mask to the scores' dtype first (fewer roundings),
    and a fully masked row is NaN as in eager. The hand-written unsafe form
    exp(x) / sum(exp(x)) is not this rule's: see softmax.stable_softmax."""

    name = "softmax.softmax"
    family = "softmax"
    chapter = 16
    relieves = ("memory:softmax", "memory:elementwise")
    anchors = ("softmax", "log_softmax", "div")
    description = (
        "softmax / log_softmax over the last dim (the op, or exp(x - max) / sum written out), "
        "with attention's scale and additive or boolean mask folded in -> opswap::softmax, "
        "log_softmax or masked_softmax: one Triton kernel, online for long rows (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if op_kind(node) == "div":
            sm = _read.read_written(gm, node)
            if isinstance(sm, _read.Softmax) and sm.form == "unsafe":
                return Refused(
                    f"{node.name} is exp(x) / sum(exp(x)) without the max subtracted, which "
                    "overflows where the kernel does not; softmax.stable_softmax (approx) "
                    "replaces it"
                )
        else:
            sm = _read.read_op(gm, node)
        if sm is None or isinstance(sm, str):
            return Refused(sm) if isinstance(sm, str) else None
        return found(sm, self.name)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        _read.install(gm, found["sm"])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return estimate(found["sm"], target)
