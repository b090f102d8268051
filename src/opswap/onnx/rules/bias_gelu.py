"""onnx.bias_gelu: a constant bias added just before an exact GELU (a MatMul's bias, then
Gelu) into com.microsoft BiasGelu: the add and the GELU in one pass over the tensor."""

from __future__ import annotations

from opswap.onnx.rule import MS_DOMAIN, OnnxRule, attr_str, const, last_dim, ok, refuse


class BiasGelu(OnnxRule):
    name = "onnx.bias_gelu"
    # it takes the Gelu that onnx.gelu makes (and runs after the residual fusion, as plans always have)
    phase = "late"
    after = ("onnx.gelu", "onnx.skip_layer_norm")
    exactness = "exact"
    description = "Add(x, constant bias) then Gelu -> com.microsoft BiasGelu."
    produces = ("BiasGelu",)
    commute = True

    variants = 2  # 0: com.microsoft Gelu, 1: ONNX Gelu (opset 20)

    def pattern(self, op, x, b):
        y = op.Add(x, b)
        if self.variant == 0:
            return op.Gelu(y, _domain=MS_DOMAIN)
        return op.Gelu(y, _allow_other_attributes=True, _outputs=["g"])

    def check(self, context, x, b, g=None, **_):
        if g is not None:
            how = attr_str(g.producer(), "approximate")
            if how != "none":
                return refuse(
                    f"the Gelu is the {how} approximation, which BiasGelu does not compute"
                )
        bias = const(b)
        if bias is None:
            return refuse("the added tensor is not a constant bias")
        if bias.ndim != 1:
            return refuse(
                f"the bias has {bias.ndim} dims; BiasGelu takes a 1-D bias over the last axis"
            )
        last = last_dim(x)
        if last != bias.shape[0]:
            return refuse(
                f"the bias has {bias.shape[0]} elements and the input's last dim is {last}"
            )
        return ok()

    def rewrite(self, op, x, b, **_):
        return op.BiasGelu(x, b, _domain=MS_DOMAIN)
