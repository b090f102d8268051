"""softmax.stable_softmax: the unsafe softmax written by hand, exp(x) / sum(exp(x), -1),
-> `opswap::softmax`, the safe one (max subtracted), as one Triton kernel."""

from __future__ import annotations

import torch.fx as fx

from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.rules.softmax import _read
from opswap.rules.softmax.softmax import estimate, found
from opswap.targets.base import Target


@register
class StableSoftmax(Rule):
    """exp(x) / sum(exp(x)) -> the safe softmax. Approx, not exact: the two are one
    function in exact arithmetic, and agree up to rounding wherever the original is
    finite and its exps do not underflow; but exp(x) overflows to inf for x > 88 in fp32
    (11 in fp16), where the original returns NaN and the replacement the right answer,
    and a row whose exps all underflow (x < -104) is 0/0 = NaN there and correct here.
    A replacement that changes outputs on some inputs is a bounded change, not the same
    function: approx, chosen only with --exactness approx."""

    name = "softmax.stable_softmax"
    family = "softmax"
    chapter = 16
    exactness = "approx"
    targets = ("cuda", "cpu")
    after = ("fusion.*",)
    relieves = ("memory:softmax", "memory:elementwise")
    anchors = ("div",)
    description = (
        "exp(x) / sum(exp(x), -1) written by hand, without the max subtraction -> "
        "opswap::softmax, the safe softmax: no overflow to inf/NaN for large scores "
        "(one Triton kernel, CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        sm = _read.read_written(gm, node)
        if sm is None or isinstance(sm, str):
            return Refused(sm) if isinstance(sm, str) else None
        if sm.form != "unsafe":
            return None  # the safe form is softmax.softmax's
        return found(sm, self.name)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        _read.install(gm, found["sm"])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return estimate(found["sm"], target)
