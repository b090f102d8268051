"""precision.bf16: a float32 Linear, Conv or matmul -> the same op in bfloat16, its inputs
cast down and its output cast back, so that the sensitive ops around it stay float32."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision._half import ANCHORS, check_half, predict_half, rewrite_half
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class BF16(Rule):
    """Run the compute-heavy ops in bfloat16: weights converted once and held as bfloat16
    buffers, activations cast down at the op and its output cast back to float32, so that
    softmax, the norms, reductions, exp and log and the loss read and write float32 as
    before. Where two such ops are joined only by ops that give the same bits in half
    (relu, views, transposes, dropout in eval), the cast pair between them goes.

    Approximate: bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%), and
    float32's range, so nothing overflows that did not before. It pays where the target
    computes bfloat16 natively (tensor cores, AMX, AVX512-BF16): predicted from the
    target's bfloat16 rate against its float32 rate; a CPU without native bfloat16 (this
    AVX2 machine: a 256 x 768 x 768 matmul ran about 12x slower in bfloat16 than in
    float32, torch 2.13 on 2 threads) is predicted slower and the planner skips it.
    """

    name = "precision.bf16"
    family = "precision"
    chapter = 6
    exactness = "approx"
    after = ("fusion.*",)
    relieves = ("compute:matmul", "compute:conv", "memory:matmul")
    description = (
        "float32 Linear / Conv / matmul -> bfloat16 (weights stored in bfloat16, casts at the "
        "edges), softmax, norms and reductions kept in float32 (approx: ~0.3% per layer)."
    )
    anchors = ANCHORS

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        return check_half(gm, node, torch.bfloat16)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        rewrite_half(gm, found)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return predict_half(gm, found, target)
