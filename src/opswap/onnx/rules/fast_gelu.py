"""onnx.fast_gelu: GELU's tanh form, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GPT-2's
NewGELU, eight ops), and ONNX's Gelu(approximate="tanh"), into com.microsoft FastGelu.
The same formula in one kernel: exact up to rounding."""

from __future__ import annotations

import math

from opswap.onnx.rule import MS_DOMAIN, OnnxRule, near, ok, refuse, scalar

_C = math.sqrt(2.0 / math.pi)


class FastGelu(OnnxRule):
    name = "onnx.fast_gelu"
    # after the erf form, the order plans have always run them in
    after = ("onnx.gelu",)
    exactness = "exact"
    description = (
        "GELU's tanh form (Pow, Mul, Add, Mul, Tanh, Add, Mul, Mul) -> com.microsoft FastGelu."
    )
    produces = ("FastGelu",)
    commute = True

    variants = 7  # x^3 as Pow or x*x*x; (x * 0.5) * b, (x * b) * 0.5, x * (b * 0.5); 6: ONNX Gelu

    def pattern(self, op, x, three, k, c, one, half):
        if self.variant == 6:
            return op.Gelu(x, approximate="tanh")
        cube = op.Pow(x, three) if self.variant % 2 == 0 else op.Mul(op.Mul(x, x), x)
        t = op.Tanh(op.Mul(op.Add(x, op.Mul(cube, k)), c))
        bracket = op.Add(t, one)
        if self.variant < 2:
            return op.Mul(op.Mul(x, half), bracket)
        if self.variant < 4:
            return op.Mul(op.Mul(x, bracket), half)
        return op.Mul(x, op.Mul(bracket, half))

    def check(self, context, x, three=None, k=None, c=None, one=None, half=None, **_):
        if self.variant == 6:
            return ok()
        if self.variant % 2 == 0 and not near(three, 3.0):
            return refuse(f"x is raised to {scalar(three)}, not cubed")
        if not near(k, 0.044715):
            return refuse(f"the cubic coefficient is {scalar(k)}, not GELU's 0.044715")
        if not near(c, _C):
            return refuse(f"tanh's scale is {scalar(c)}, not sqrt(2/pi)")
        if not near(one, 1.0) or not near(half, 0.5):
            return refuse("the constants around Tanh are not 1 and 0.5, so this is not GELU")
        return ok()

    def rewrite(self, op, x, **_):
        return op.FastGelu(x, _domain=MS_DOMAIN)
