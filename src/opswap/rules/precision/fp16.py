"""precision.fp16: a float32 Linear, Conv or matmul -> the same op in float16, refused where
the example's values come near float16's range."""

from __future__ import annotations

import torch

from opswap.rules.precision._half_rule import HalfRule
from opswap.rules.registry import register


@register
class FP16(HalfRule):
    """Run the compute-heavy ops in float16, the rest in float32, as precision.bf16 does.

    float16 rounds finer than bfloat16 (11 bits of mantissa, 2^-12 = 0.02%) but its
    largest finite value is 65504: a site whose input, output or weight reaches a quarter
    of that at the example is refused with the value (the example is one sample; the
    quarter is headroom for others), and bfloat16 is the type for it. Predicted from the
    target's float16 rate; a CPU without native float16 arithmetic is predicted slower.
    """

    name = "precision.fp16"
    dtype = torch.float16
    description = (
        "float32 Linear / Conv / matmul -> float16 (weights stored in float16, casts at the "
        "edges), refused where values near float16's 65504 limit (approx: ~0.05% per layer)."
    )
