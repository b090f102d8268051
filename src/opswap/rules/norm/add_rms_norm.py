"""norm.add_rms_norm: `s = a + b; y = rmsnorm(s)` (the decoder layer's residual add
and the next norm) -> `opswap::add_rms_norm`, one kernel returning (y, s)."""

from __future__ import annotations

import torch.fx as fx

from opswap.graph.ops import op_kind
from opswap.graph.shapes import info
from opswap.rules import _triton
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.norm import _rms
from opswap.rules.norm.rms_norm import describe, estimate, install
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class AddRMSNormTriton(_triton.TritonRule):
    """The residual add and the RMSNorm it feeds, in one pass: the kernel reads a and b,
    writes the sum (the residual stream its later readers take) and the normalised
    output, so the sum is never re-read. Exact, as norm.rms_norm: the sum is
    rounded to the input dtype as eager's add rounds it, then normalised in fp32."""

    name = "norm.add_rms_norm"
    family = "norm"
    chapter = 10
    before = ("norm.rms_norm",)
    relieves = ("memory:normalization", "memory:elementwise")
    anchors = ("rsqrt", "rms_norm")
    description = (
        "Residual add feeding an RMSNorm -> opswap::add_rms_norm: one Triton kernel writes "
        "the normalised output and the sum (the residual its later readers take) (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        rms = _rms.read(gm, node)
        if rms is None or isinstance(rms, str):
            return None  # norm.rms_norm reports the reason
        add, alias = rms.x, None
        if _rms.not_a_cast(add) and isinstance(add.args[0], fx.Node):
            # a float32 model's no-op upcast, which export also hands to the sum's readers
            add, alias = add.args[0], add
        if op_kind(add) != "add" or len(add.args) != 2 or add.kwargs:
            return None
        a, b = add.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return Refused(f"{add.name} adds a number, not a residual tensor")
        ia, ib, isum = info(a), info(b), info(add)
        if ia is None or ib is None or isum is None:
            return Refused(f"the shapes of {add.name}'s operands are unknown")
        if ia.shape != ib.shape or ia.dtype != ib.dtype or ia.shape != isum.shape:
            return Refused(
                f"{add.name} broadcasts or promotes ({list(ia.shape)} {ia.dtype} + "
                f"{list(ib.shape)} {ib.dtype}); the kernel adds two tensors of one shape and dtype"
            )
        nodes = [add, *([alias] if alias is not None else []), *rms.nodes]
        total = alias if alias is not None else add
        return Found(
            nodes,
            f"fold the residual add {add.name} into the {describe(rms)}: opswap::add_rms_norm",
            dict(rms=rms, add=add, total=total),
            key=f"{add.name}..{rms.out.name}",
            outputs=(total, rms.out),
            record=dict(add=add.name, out=rms.out.name, eps=rms.eps),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        install(gm, found["rms"], residual=found["add"], total=found["total"])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return estimate(gm, found["rms"], target, "add_rms_norm", found.nodes, residual=True)
