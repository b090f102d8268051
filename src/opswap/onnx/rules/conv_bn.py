"""onnx.conv_bn: an inference BatchNormalization after a Conv, both with constant
parameters, folded into the Conv's weight and bias: W' = W * s, b' = (b - mean) * s + beta,
s = gamma / sqrt(var + eps), one per output channel."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opswap.onnx.rule import OnnxRule, attr_float, attr_int, const, ok, refuse


class ConvBn(OnnxRule):
    name = "onnx.conv_bn"
    # a cancelled Transpose pair between a Conv and its BatchNormalization leaves the two adjacent
    phase = "early"
    after = ("onnx.transpose_pair",)
    exactness = "exact"
    description = "Conv then BatchNormalization (constant statistics) -> one Conv with folded weight and bias."
    produces = ("Conv",)

    def pattern(self, op, x, w, scale, shift, mean, var):
        y = op.Conv(x, w, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["conv"])
        return op.BatchNormalization(
            y, scale, shift, mean, var, _allow_other_attributes=True, _outputs=["bn"]
        )

    def check(self, context, x, w, scale, shift, mean, var, conv, bn, **_):
        node = bn.producer()
        if attr_int(node, "training_mode", 0):
            return refuse("the BatchNormalization is in training mode")
        if len([o for o in node.outputs if o.uses()]) > 1:
            return refuse("the BatchNormalization's running statistics are read")
        if const(w) is None:
            return refuse("the Conv's weight is not a constant")
        inputs = conv.producer().inputs
        if len(inputs) > 2 and inputs[2] is not None and const(inputs[2]) is None:
            return refuse("the Conv's bias is not a constant")
        for v, what in ((scale, "scale"), (shift, "shift"), (mean, "mean"), (var, "variance")):
            if const(v) is None:
                return refuse(f"the BatchNormalization's {what} is not a constant")
        return ok()

    def rewrite(self, op, x, w, scale, shift, mean, var, conv, bn, **_):
        cnode = conv.producer()
        eps = attr_float(bn.producer(), "epsilon")
        weight = const(w)
        assert weight is not None
        s = const(scale) / np.sqrt(const(var) + eps)  # type: ignore[operator]
        b = const(cnode.inputs[2]) if len(cnode.inputs) > 2 and cnode.inputs[2] is not None else 0.0
        folded_w = (weight * s.reshape(-1, *([1] * (weight.ndim - 1)))).astype(weight.dtype)
        folded_b = ((b - const(mean)) * s + const(shift)).astype(weight.dtype)  # type: ignore[operator]
        return op.Conv(
            x,
            op.Constant(value=ir.tensor(folded_w)),
            op.Constant(value=ir.tensor(folded_b)),
            **{k: a for k, a in cnode.attributes.items()},
        )
