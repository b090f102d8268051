"""onnx.skip_layer_norm: a residual Add feeding a LayerNormalization into com.microsoft
SkipLayerNormalization: the add, the mean and the variance in one pass. When the sum is
also read elsewhere (the next residual of a pre-LN block), those readers take the fused
op's fourth output, the sum itself, so nothing is computed twice. The bias of the dense
layer before the residual (MatMul + b) is taken into the fused op as its bias input."""

from __future__ import annotations

from opswap.onnx.rule import (
    MS_DOMAIN,
    OnnxRule,
    attr_float,
    attr_int,
    bias_of,
    const,
    ok,
    rank,
    refuse,
)


class SkipLayerNorm(OnnxRule):
    name = "onnx.skip_layer_norm"
    # the embeddings' last Add and LayerNormalization would otherwise match as a residual
    phase = "late"
    after = ("onnx.embed_layer_norm",)
    exactness = "exact"
    description = (
        "Add(x, residual) then LayerNormalization -> com.microsoft SkipLayerNormalization."
    )
    produces = ("SkipLayerNormalization",)
    keeps_nodes = True  # the Add may have other readers: they are moved to output 3

    def pattern(self, op, a, b, gamma, beta):
        s = op.Add(a, b, _outputs=["summed"])
        return op.LayerNormalization(s, gamma, beta, _allow_other_attributes=True, _outputs=["ln"])

    def check(self, context, a, b, gamma, beta, summed, ln, **_):
        node = ln.producer()
        if len([o for o in node.outputs if o.uses()]) > 1:
            return refuse("the LayerNormalization's mean or inverse deviation is read too")
        r = rank(summed)
        axis = attr_int(node, "axis")
        if r not in (2, 3):
            return refuse(f"the input has rank {r}; SkipLayerNormalization takes 2-D or 3-D input")
        if axis not in (-1, r - 1):
            return refuse(f"the LayerNormalization is over axis {axis}, not the last")
        if a.shape is None or b.shape is None or list(a.shape) != list(b.shape):
            return refuse(
                f"the Add broadcasts ({a.shape} + {b.shape}); SkipLayerNormalization adds two "
                "tensors of one shape"
            )
        for v, what in ((gamma, "scale"), (beta, "shift")):
            t = const(v)
            if t is None or t.ndim != 1:
                return refuse(f"the LayerNormalization's {what} is not a 1-D constant")
        return ok()

    def rewrite(self, op, a, b, gamma, beta, summed, ln, **_):
        eps = attr_float(ln.producer(), "epsilon")
        readers = [u for u in summed.uses() if u.node is not ln.producer()]
        inputs = [a, b, gamma, beta]
        for i, v in ((0, a), (1, b)):  # the dense layer's bias, added inside the norm
            found = bias_of(v)
            if found is not None:
                inputs[i] = found[0]
                inputs.append(found[1])
                break
        if not readers:
            return op.SkipLayerNormalization(*inputs, epsilon=eps, _domain=MS_DOMAIN)
        outs = op.SkipLayerNormalization(*inputs, epsilon=eps, _domain=MS_DOMAIN, _outputs=4)
        outs[3].shape, outs[3].type = summed.shape, summed.type
        summed.replace_all_uses_with(outs[3])  # the graph is sorted again after each rule
        return outs[0]
