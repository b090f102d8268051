"""fusion.conv_bn: fold an inference BatchNorm into the convolution before it."""

from __future__ import annotations

import torch.fx as fx

from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.fusion._bn_fold import bn_fold_check, bn_saving, fold_into
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class ConvBatchNorm(Rule):
    """Fold an inference BatchNorm into the convolution before it.

    In eval mode BatchNorm is a per-channel affine map, y = x * s + t, so it can
    be multiplied into the conv's weight (w * s per output channel) and bias
    (b * s + t). The BN kernel, and with it a full write and re-read of the conv
    output, disappears. Also handles transposed convolutions.
    """

    name = "fusion.conv_bn"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    targets = ("any",)
    relieves = ("memory:normalization",)
    description = (
        "Conv (1d/2d/3d, also transposed) + eval BatchNorm -> one conv with the BN "
        "folded into its weight and bias; saves the BN's read and write of the conv "
        "output."
    )

    anchors = ("batch_norm",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        return bn_fold_check(gm, node, ("conv", "conv_transpose"), "conv")

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        fold_into(gm, found)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return bn_saving(
            target,
            found,
            "BatchNorm folded into the conv weights: one "
            "read and one write of the conv output saved",
        )
