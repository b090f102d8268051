"""precision.bf16: a float32 Linear, Conv or matmul -> the same op in bfloat16, its inputs
cast down and its output cast back, so that the sensitive ops around it stay float32."""

from __future__ import annotations

import torch

from opswap.rules.precision._half_rule import HalfRule
from opswap.rules.registry import register


@register
class BF16(HalfRule):
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
    dtype = torch.bfloat16
    description = (
        "float32 Linear / Conv / matmul -> bfloat16 (weights stored in bfloat16, casts at the "
        "edges), softmax, norms and reductions kept in float32 (approx: ~0.3% per layer)."
    )
