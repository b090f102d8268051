"""fusion.linear_bn: fold an inference BatchNorm1d on a Linear's [N, C] output into it."""

from __future__ import annotations

import torch.fx as fx

from opswap.graph.shapes import shape
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.fusion._bn_fold import bn_fold_check, bn_saving, fold_into
from opswap.rules.registry import register
from opswap.targets.base import Target


def _output_is_2d(src: fx.Node, bn: fx.Node) -> str | None:
    out = shape(src)
    if out is None:
        return f"the shape of {src.name}'s output is unknown"
    if len(out) != 2:
        return (
            f"{src.name}'s output is {len(out)}-D: BatchNorm {bn.name} normalises "
            "dim 1, not the Linear's output features (the last dim)"
        )
    return None


@register
class LinearBatchNorm(Rule):
    """Fold an inference BatchNorm1d on a Linear's [N, C] output into the Linear.

    Same algebra as conv_bn, with the output features as channels. Only a 2-D
    output qualifies: BatchNorm1d on [N, C, L] normalises dim 1, which is not a
    Linear's feature dim (the last one).
    """

    name = "fusion.linear_bn"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    relieves = ("memory:normalization",)
    description = (
        "Linear + eval BatchNorm1d on [N, C] -> one Linear with the BN folded in; "
        "saves the BN's read and write of the Linear output."
    )

    anchors = ("batch_norm",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        return bn_fold_check(gm, node, ("linear",), "linear", _output_is_2d)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        fold_into(gm, found)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return bn_saving(
            target,
            found,
            "BatchNorm folded into the Linear weights: one "
            "read and one write of the Linear output saved",
        )
