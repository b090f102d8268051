"""The one rule class behind precision.bf16 and precision.fp16, which differ only in the
half type they run the compute-heavy ops in, their names and descriptions (one file each)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.fx as fx

from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision._half import ANCHORS, check_half, predict_half, rewrite_half
from opswap.targets.base import Target


class HalfRule(Rule):
    """float32 Linear / Conv / matmul -> the same op in `dtype`, casts at the edges."""

    family = "precision"
    chapter = 6
    exactness = "approx"
    after = ("fusion.*",)
    relieves = ("compute:matmul", "compute:conv", "memory:matmul")
    anchors = ANCHORS
    dtype: ClassVar[torch.dtype]

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        return check_half(gm, node, self.dtype)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        rewrite_half(gm, found)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return predict_half(gm, found, target)
