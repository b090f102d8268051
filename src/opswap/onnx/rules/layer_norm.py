"""onnx.layer_norm: LayerNorm written out (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div,
Mul, Add: what exporters before opset 17 emit) into one LayerNormalization over the last
axis. ONNX Runtime runs LayerNormalization in the default domain at every opset."""

from __future__ import annotations

from opswap.onnx.rule import OnnxRule, const, last_axis, near, ok, rank, reduce_axes, refuse, scalar


class LayerNorm(OnnxRule):
    name = "onnx.layer_norm"
    exactness = "exact"
    description = "Decomposed LayerNorm over the last axis (nine ops) -> LayerNormalization."
    produces = ("LayerNormalization",)
    commute = True

    def pattern(self, op, x, two, eps, gamma, beta):
        mean = op.ReduceMean(
            x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["mean"]
        )
        d = op.Sub(x, mean)
        var = op.ReduceMean(
            op.Pow(d, two), _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["var"]
        )
        n = op.Div(d, op.Sqrt(op.Add(var, eps)))
        return op.Add(op.Mul(n, gamma), beta)

    def check(self, context, x, two, eps, gamma, beta, mean, var, **_):
        r = rank(x)
        for v, what in ((mean, "mean"), (var, "variance")):
            axes = reduce_axes(v.producer())
            if not last_axis(axes, r):
                return refuse(f"the {what} is taken over axes {axes}, not the last axis alone")
        if not near(two, 2.0):
            return refuse(f"the deviation is raised to {scalar(two)}, not squared")
        if scalar(eps) is None:
            return refuse("epsilon is not a constant")
        last = x.shape[-1] if x.shape is not None and r else None
        for v, what in ((gamma, "scale"), (beta, "shift")):
            a = const(v)
            if a is None:
                return refuse(f"the {what} is not a constant")
            if a.ndim != 1 or not isinstance(last, int) or a.shape[0] != last:
                return refuse(
                    f"the {what} has shape {list(a.shape)}, not [{last}] (the normalized axis)"
                )
        return ok()

    def rewrite(self, op, x, eps, gamma, beta, **_):
        return op.LayerNormalization(x, gamma, beta, axis=-1, epsilon=scalar(eps))
