"""conv.cp: a dense k x k conv -> 1x1, depthwise k x 1, depthwise 1 x k, 1x1 from a rank-R
CP decomposition of its trained weight (Lebedev et al. 2015). Lossy."""

from __future__ import annotations

import torch

from opswap.rules.conv._decompose import Decomposition, Layer, max_rank, smallest
from opswap.rules.conv._lossy import KEEP, MAX_WEIGHT_ERROR, LossyConv
from opswap.rules.registry import register


@register
class CP(LossyConv):
    """W[o, c, y, x] ~ sum_r A[o, r] B[c, r] Y[y, r] X[x, r], fitted by alternating least
    squares (rules/conv/_decompose.py: `cp_als`, deterministic from an SVD start), becomes
    four convs: 1x1 [R, C] (B), depthwise [R, kh x 1] (Y, with the vertical stride,
    padding and dilation), depthwise [R, 1 x kw] (X, the horizontal ones), 1x1 [O, R]
    (A, with the bias). The rank is the smallest, found by bisection, whose kernel errs at
    most MAX_WEIGHT_ERROR and whose chain costs at most 90% of the conv's multiply-adds.

    Lossy, and more so than the SVD splits at the same cost: trained kernels seldom have
    low CP rank, so this rule refuses most convs as they are, with the rank it would need.
    It is the strongest compression of the four when followed by fine-tuning (Lebedev et
    al. fine-tune after it): opswap.train.distill_conv.decompose(method="cp", rank=R) then
    fine_tune. A 1x1 conv is refused (it has no spatial factors; conv.low_rank splits it).
    """

    name = "conv.cp"
    description = (
        "Dense conv -> 1x1, depthwise kx1, depthwise 1xk, 1x1 from a CP decomposition "
        "of the weight by ALS (Lebedev et al.; lossy)."
    )

    def fit(self, conv: Layer, h: int, w: int, inputs: torch.Tensor) -> Decomposition | str:
        if conv.groups != 1:
            return f"it has groups={conv.groups}; a CP decomposition takes ungrouped convs"
        if conv.kernel_size == (1, 1):
            return (
                "a 1x1 conv has no spatial factors to separate (conv.low_rank splits its channels)"
            )
        limit = max_rank(conv, "cp", h, w, KEEP)
        d = smallest(conv, "cp", MAX_WEIGHT_ERROR, limit)
        if d is None:
            return (
                f"a CP decomposition saves {1 - KEEP:.0%} of the multiply-adds only up to rank "
                f"{limit}, where its weight errs more than {MAX_WEIGHT_ERROR}, so it saves nothing"
            )
        return d
