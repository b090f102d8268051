"""conv.low_rank: a dense k x k conv -> two thin convs from a truncated SVD of its trained
weight, the channel split or the spatial one, whichever costs less at the error bound.
Lossy."""

from __future__ import annotations

import torch

from opswap.rules.conv._decompose import (
    Decomposition,
    Layer,
    channel_rank,
    max_rank,
    smallest,
    spatial_rank,
)
from opswap.rules.conv._lossy import KEEP, MAX_WEIGHT_ERROR, LossyConv
from opswap.rules.registry import register


@register
class LowRank(LossyConv):
    """A conv [O, C, kh, kw] -> two convs of rank r, the SVD truncated at the smallest r
    whose kernel errs at most MAX_WEIGHT_ERROR (relative L2 of the weight, 0.1: 99% of its
    energy kept). Two splits are tried and the cheaper one that saves at least 10% of the
    multiply-adds at the example's size is taken:

    - channel: [r, C, kh, kw] (the stride, padding and dilation) then 1x1 [O, r] (the bias),
      the SVD of W as [O, C*kh*kw]; pays where r is well under O;
    - spatial: [r, C, kh, 1] then [O, r, 1, kw], padding and stride split per axis, the SVD
      of W as [C*kh, O*kw] (Jaderberg et al. 2014); pays where the kernel is nearly
      separable along its axes.

    Lossy: the discarded singular values are the change of function; the Found states the
    output's relative error on the capture's calibration samples (random inputs without
    them), and a site over the lossy bound is refused with it. Grouped convs are refused
    (they are thin already). opswap.train.distill_conv decomposes at a rank of the user's
    choosing and fine-tunes the result.
    """

    name = "conv.low_rank"
    # where several decompositions match one conv, the more faithful goes first
    before = ("conv.cp", "conv.depthwise_separable")
    description = (
        "Dense conv -> two thin convs from a truncated SVD of the weight (channel split "
        "[r,C,k,k]+1x1, or spatial kx1+1xk), rank by an error bound (lossy)."
    )

    def fit(self, conv: Layer, h: int, w: int, inputs: torch.Tensor) -> Decomposition | str:
        if conv.groups != 1:
            return f"it has groups={conv.groups}; a low-rank split takes ungrouped convs (a grouped conv is thin already)"
        kh, kw = conv.kernel_size
        tried = []
        found = []
        for method in ("channel", "spatial"):
            if method == "spatial" and (kh == 1 or kw == 1):
                continue
            limit = max_rank(conv, method, h, w, KEEP)
            d = smallest(conv, method, MAX_WEIGHT_ERROR, limit)
            if d is not None:
                found.append(d)
                continue
            need = (channel_rank if method == "channel" else spatial_rank)(conv, MAX_WEIGHT_ERROR)
            tried.append(
                f"the {method} split needs rank {need} for weight error <= {MAX_WEIGHT_ERROR} and saves {1 - KEEP:.0%} of the multiply-adds only up to rank {limit}"
            )
        if not found:
            return "; ".join(tried) + ", so it saves nothing"
        return min(found, key=lambda d: d.macs(h, w))
