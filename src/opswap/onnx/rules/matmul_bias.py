"""onnx.matmul_bias: a 2-D MatMul by a constant weight followed by a constant bias Add into
one Gemm, whose kernel adds the bias while the product is still in registers. 3-D inputs
(a transformer's [batch, sequence, hidden]) are left to the fused ops that take the bias
themselves (BiasGelu, SkipLayerNormalization) and to ONNX Runtime's own MatMul+Add fusion."""

from __future__ import annotations

from opswap.onnx.rule import OnnxRule, const, ok, rank, refuse


class MatMulBias(OnnxRule):
    name = "onnx.matmul_bias"
    # it takes the bias Adds that the fused ops taking a bias left
    phase = "late"
    after = ("onnx.attention", "onnx.bias_gelu", "onnx.skip_layer_norm")
    exactness = "exact"
    description = "Add(MatMul(x, W), b) on 2-D x with constant W and b -> Gemm."
    produces = ("Gemm",)
    commute = True

    def pattern(self, op, x, w, b):
        return op.Add(op.MatMul(x, w), b)

    def check(self, context, x, w, b, **_):
        if rank(x) != 2:
            return refuse(f"the MatMul's input has rank {rank(x)}; Gemm takes a 2-D input")
        weight, bias = const(w), const(b)
        if weight is None or weight.ndim != 2:
            return refuse("the MatMul's weight is not a 2-D constant")
        if bias is None:
            return refuse("the added tensor is not a constant bias")
        if (
            bias.ndim > 1
            and bias.shape[0] != 1
            or bias.shape[-1:] not in ((weight.shape[1],), (1,))
        ):
            return refuse(
                f"the bias of shape {list(bias.shape)} is not one value per output column"
            )
        return ok()

    def rewrite(self, op, x, w, b, **_):
        return op.Gemm(x, w, b)
