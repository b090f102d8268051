"""precision.int8_weight_only: a bfloat16/float16 Linear on few rows -> INT8 weights per
output channel, activations unchanged, our Triton GEMV (`opswap::wo_linear`)."""

from __future__ import annotations

from opswap.rules.precision._weight_only_rule import WeightOnlyRule
from opswap.rules.registry import register


@register
class Int8WeightOnly(WeightOnlyRule):
    """Half the weight's bytes for memory-bound decoding. Approximate: symmetric per-channel
    INT8 moves a layer's output by about 0.9% (relative L2) on random weights, inside the
    approx tolerance."""

    name = "precision.int8_weight_only"
    exactness = "approx"
    bits = 8
    description = (
        "bfloat16 Linear on <= 16 rows (decoding) -> INT8 weights per channel, dequantised "
        "in registers by a Triton GEMV (approx: ~1% error per layer)."
    )
