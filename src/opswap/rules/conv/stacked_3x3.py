"""conv.stacked_3x3: a k x k conv (k = 5, 7, 9, ...) -> (k-1)/2 stacked 3x3 convs with the
same receptive field, fitted to it on sample data. Lossy."""

from __future__ import annotations

import torch

from opswap.rules.conv._decompose import (
    Decomposition,
    Layer,
    stack_layers,
    stacked_3x3,
    stacked_count,
)
from opswap.rules.conv._lossy import KEEP, LossyConv
from opswap.rules.registry import register


def mid_channels(conv: Layer, h: int, w: int, keep: float = KEEP) -> int:
    """The widest middle (a multiple of the groups, from min(C, O) to max(C, O)) whose
    stack costs at most `keep` of the conv's multiply-adds at an h x w input; 0 when none
    does (a middle narrower than both ends would cap the map's rank below the conv's)."""
    n = stacked_count(conv)
    assert isinstance(n, int)
    g, o = conv.groups, conv.out_channels
    c = conv.in_channels
    budget = keep * conv.macs(h, w)
    best = 0
    for m in range(-(-min(c, o) // g) * g, max(c, o) + 1, g):
        sizes = [(c, m)] + [(m, m)] * (n - 2) + [(m, o)]
        ws = [torch.empty(co, ci // g, 3, 3, device="meta") for ci, co in sizes]
        chain = stack_layers(conv, ws)
        macs, hh, ww = 0, h, w
        for layer in chain:
            macs += layer.macs(hh, ww)
            hh, ww = layer.out_size(hh, ww)
        if macs > budget:
            break
        best = m
    return best


@register
class Stacked3x3(LossyConv):
    """A k x k conv -> (k-1)/2 convs 3x3 (VGG's observation: two 3x3 see what one 5x5
    sees, with 18 weights per channel pair instead of 25). No activation between them, so
    that the stack stays a linear map and can stand for the conv's; all the padding sits on
    the first conv and the stride on the last, which makes the stack exactly a conv with
    the kernel its 3x3s compose to (dilation and groups carried to each). The middle width
    is max(C, O), narrowed until the stack costs at most 90% of the conv's multiply-adds.

    The weights are distilled: Adam on the composed kernel against W (what a fit of the
    outputs on white-noise inputs converges to), then Adam on the conv's outputs for the
    capture's calibration samples (the lossy plan's: the task's training batches, the
    user's data, or random inputs like the example's; the Found says which). Lossy: not
    every k x k kernel is a product of 3x3s at that width; the output error is reported,
    and a site over the lossy bound refused. opswap.train.distill_conv.fine_tune then
    trains the whole model on its task.
    """

    name = "conv.stacked_3x3"
    # where several decompositions match one conv, the more faithful goes first
    before = ("conv.low_rank", "conv.cp", "conv.depthwise_separable")
    description = (
        "Large-kernel conv (5x5, 7x7, ...) -> (k-1)/2 stacked 3x3 convs without activations "
        "between, distilled on sample data (lossy)."
    )

    def fit(self, conv: Layer, h: int, w: int, inputs: torch.Tensor) -> Decomposition | str:
        n = stacked_count(conv)
        if isinstance(n, str):
            return n
        mid = mid_channels(conv, h, w)
        if mid == 0:
            k = conv.kernel_size[0]
            why = (
                " (the stride must sit on the last 3x3, so the others run at full resolution)"
                if conv.stride != (1, 1)
                else ""
            )
            return (
                f"{n} stacked 3x3 convs cost more than {KEEP:.0%} of the {k}x{k} conv's "
                f"multiply-adds even {min(conv.in_channels, conv.out_channels)} channels "
                f"wide{why}, so they save nothing"
            )
        return stacked_3x3(conv, mid, inputs=inputs)
