"""precision.int4_weight_only: a bfloat16/float16 Linear on few rows -> INT4 weights in
groups of 128 with a scale and offset each, packed two per byte, our Triton GEMV
(`opswap::wo_linear`)."""

from __future__ import annotations

from opswap.rules.precision._weight_only_rule import WeightOnlyRule
from opswap.rules.registry import register


@register
class Int4WeightOnly(WeightOnlyRule):
    """A quarter of the weight's bytes (plus an eighth for the scales) for memory-bound
    decoding. Lossy: 16 levels per group move a layer's output by 7-10% (relative L2) on
    random weights, outside the approx tolerance; trained models lose less, and the user's
    budget or the accuracy task decides."""

    name = "precision.int4_weight_only"
    exactness = "lossy"
    bits = 4
    before = ("precision.int8_weight_only",)  # where both are allowed, the smaller weight first
    description = (
        "bfloat16 Linear on <= 16 rows (decoding) -> INT4 weights in groups of 128 "
        "(scale + offset), packed two per byte, Triton GEMV (lossy: 7-10% error per layer)."
    )
