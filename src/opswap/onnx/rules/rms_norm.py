"""onnx.rms_norm: RMSNorm written out, x / sqrt(mean(x^2) + eps) * w (LLaMA's, T5's), into
ONNX Runtime's SimplifiedLayerNormalization (default domain, a contrib op ORT runs)."""

from __future__ import annotations

from opswap.onnx.rule import OnnxRule, const, last_axis, near, ok, rank, reduce_axes, refuse, scalar


class RmsNorm(OnnxRule):
    name = "onnx.rms_norm"
    # a written-out LayerNorm holds x / sqrt(mean(x^2) + eps) * gamma over the centred x: it is taken whole first
    after = ("onnx.layer_norm",)
    exactness = "exact"
    description = "x * 1/sqrt(mean(x^2) + eps) * w -> SimplifiedLayerNormalization."
    produces = ("SimplifiedLayerNormalization",)
    commute = True
    variants = 4  # x^2 as Pow or Mul; x * Reciprocal(sqrt) or x / sqrt

    def pattern(self, op, x, two, eps, w):
        sq = op.Pow(x, two) if self.variant % 2 == 0 else op.Mul(x, x)
        ms = op.ReduceMean(
            sq, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["ms"]
        )
        root = op.Sqrt(op.Add(ms, eps))
        n = op.Mul(x, op.Reciprocal(root)) if self.variant < 2 else op.Div(x, root)
        return op.Mul(n, w)

    def check(self, context, x, eps, w, ms, two=None, **_):
        axes = reduce_axes(ms.producer())
        if not last_axis(axes, rank(x)):
            return refuse(f"the mean square is taken over axes {axes}, not the last axis alone")
        if self.variant % 2 == 0 and not near(two, 2.0):
            return refuse(f"x is raised to {scalar(two)}, not squared")
        if scalar(eps) is None:
            return refuse("epsilon is not a constant")
        a = const(w)
        last = x.shape[-1] if x.shape is not None and rank(x) else None
        if a is None:
            return refuse("the weight is not a constant")
        if a.ndim != 1 or not isinstance(last, int) or a.shape[0] != last:
            return refuse(
                f"the weight has shape {list(a.shape)}, not [{last}] (the normalized axis)"
            )
        return ok()

    def rewrite(self, op, x, eps, w, **_):
        return op.SimplifiedLayerNormalization(x, w, axis=-1, epsilon=scalar(eps), stash_type=1)
