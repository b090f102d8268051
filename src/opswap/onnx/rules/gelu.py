"""onnx.gelu: GELU written out with Erf, x * 0.5 * (1 + erf(x / sqrt(2))), into one
com.microsoft Gelu (the exact GELU, one pass over x instead of five)."""

from __future__ import annotations

import math

from opswap.onnx.rule import MS_DOMAIN, OnnxRule, near, ok, refuse, scalar


class Gelu(OnnxRule):
    name = "onnx.gelu"
    # the activations after the norms, the order plans have always run them in
    after = ("onnx.layer_norm", "onnx.rms_norm")
    exactness = "exact"
    description = "x * 0.5 * (1 + erf(x / sqrt 2)) (Div, Erf, Add, Mul, Mul) -> com.microsoft Gelu."
    produces = ("Gelu",)
    commute = True

    variants = 6  # x / sqrt2 or x * (1 / sqrt2); (x * 0.5) * b, (x * b) * 0.5 or x * (b * 0.5)

    def pattern(self, op, x, root, one, half):
        inner = op.Div(x, root) if self.variant % 2 == 0 else op.Mul(x, root)
        bracket = op.Add(op.Erf(inner), one)
        if self.variant < 2:
            return op.Mul(op.Mul(x, half), bracket)
        if self.variant < 4:
            return op.Mul(op.Mul(x, bracket), half)
        return op.Mul(x, op.Mul(bracket, half))

    def check(self, context, x, root, one, half, **_):
        want = math.sqrt(2.0) if self.variant % 2 == 0 else 1 / math.sqrt(2.0)
        if not near(root, want):
            return refuse(f"Erf's argument is x scaled by {scalar(root)}, not by 1/sqrt(2)")
        if not near(one, 1.0) or not near(half, 0.5):
            return refuse("the constants around Erf are not 1 and 0.5, so this is not GELU")
        return ok()

    def rewrite(self, op, x, **_):
        return op.Gelu(x, _domain=MS_DOMAIN)
