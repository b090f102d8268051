"""conv.depthwise_separable: a dense k x k conv -> depthwise k x k + pointwise 1x1, fitted
from its trained weight by a per-channel low-rank approximation. Lossy."""

from __future__ import annotations

import torch

from opswap.rules.conv._decompose import Decomposition, Layer, max_rank, smallest
from opswap.rules.conv._lossy import KEEP, MAX_WEIGHT_ERROR, LossyConv
from opswap.rules.registry import register


@register
class DepthwiseSeparable(LossyConv):
    """Per input channel c, W[:, c] (as [O, kh*kw]) ~ P_c D_c with D_c [m, kh*kw] the m
    depthwise filters of channel c and P_c [O, m] their pointwise weights: the best rank-m
    approximation (SVD), which is the least-squares fit. The conv becomes a depthwise conv
    [C*m, 1, kh, kw] (groups=C, the stride, padding and dilation) and a 1x1 [O, C*m] with
    the bias, MobileNet's block without the activation between. m (the depth multiplier)
    is the smallest whose kernel errs at most MAX_WEIGHT_ERROR within 90% of the conv's
    multiply-adds; m = 1 is the classic split.

    Lossy: a trained dense conv is rarely close to separable per channel, so most sites
    are refused as they stand, with the multiplier they would need; the way to get a
    depthwise-separable model is opswap.train.distill_conv.decompose(method="depthwise")
    and fine_tune, whose accuracy on the digits task is in
    docs/chapters/11-convolution-decompositions.md. Grouped convs are refused (a depthwise
    conv is one already).
    """

    name = "conv.depthwise_separable"
    # where several decompositions match one conv, the more faithful goes first
    before = ("conv.cp",)
    description = (
        "Dense conv -> depthwise kxk + pointwise 1x1, fitted per input channel by a "
        "low-rank (SVD) least-squares fit of the weight (lossy)."
    )

    def fit(self, conv: Layer, h: int, w: int, inputs: torch.Tensor) -> Decomposition | str:
        if conv.groups != 1:
            if conv.groups == conv.in_channels:
                return "it is a depthwise conv already"
            return f"it has groups={conv.groups}; a depthwise-separable split takes ungrouped convs"
        if conv.kernel_size == (1, 1):
            return "a 1x1 conv is pointwise already"
        limit = max_rank(conv, "depthwise", h, w, KEEP)
        d = smallest(conv, "depthwise", MAX_WEIGHT_ERROR, limit)
        if d is None:
            return (
                f"a depthwise-separable split saves {1 - KEEP:.0%} of the multiply-adds only up "
                f"to depth multiplier {limit}, where its weight errs more than "
                f"{MAX_WEIGHT_ERROR}, so it saves nothing"
            )
        return d
