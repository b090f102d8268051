"""opswap::int8_static_linear and opswap::int8_static_conv2d -> QuantizeLinear /
DequantizeLinear around MatMul or Conv (+ Relu, Gelu), a uint8 input or output as is.

The Linear has two forms (Options.int8, INT8_FORMS): "qdq", the interchange form that
OpenVINO runs as an int8 GEMM, and "integer", MatMulInteger then the rescale, which ONNX
Runtime's CPU provider runs as one. The QDQ pairs round halves to even where the op rounds
them up: the two differ only on an input that lands exactly on a half step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op, u8
from opswap.backends.lowerings._registry import Options, lowering


def qdq_input(x: Any, x_scale: float, x_zp: int) -> Any:
    s = op.Constant(value_float=float(x_scale))
    z = op.Constant(value=u8(int(x_zp), scalar=True))
    return op.DequantizeLinear(op.QuantizeLinear(as_float(x), s, z), s, z)


def qdq_weight(wq: Any, w_scale: Any) -> Any:
    if len(w_scale.shape) == 0 or w_scale.shape[0] == 1:
        return op.DequantizeLinear(wq, op.Reshape(w_scale, ints([])))
    return op.DequantizeLinear(wq, w_scale, axis=0)


def static_input(x: Any, x_scale: float, x_zp: int) -> Any:
    """The layer's float input: a uint8 one (handed over already quantised with
    (x_scale, x_zp)) dequantised, a float one through its quantise-dequantise pair."""
    from onnx_ir import DataType

    if x.dtype != DataType.UINT8:
        return qdq_input(x, x_scale, x_zp)
    s = op.Constant(value_float=float(x_scale))
    return op.DequantizeLinear(x, s, op.Constant(value=u8(int(x_zp), scalar=True)))


def static_output(y: Any, x: Any, post: str, out_scale: float, out_zp: int) -> Any:
    """The epilogue: the activation, then uint8 by (out_scale, out_zp) when out_scale > 0,
    else x's float dtype (float32 for a uint8 x)."""
    from onnx_ir import DataType

    if post == "relu":
        y = op.Relu(y)
    elif post in ("gelu", "gelu_tanh"):
        y = op.Gelu(y, approximate="tanh" if post == "gelu_tanh" else "none")
    if out_scale > 0:
        s = op.Constant(value_float=float(out_scale))
        return op.QuantizeLinear(y, s, op.Constant(value=u8(int(out_zp), scalar=True)))
    return y if x.dtype == DataType.UINT8 else back(y, x)


@lowering(
    "opswap::int8_static_linear",
    "QuantizeLinear/DequantizeLinear + MatMul (+ Relu, Gelu)",
    takes_options=True,
)
def int8_static_linear_for(options: Options) -> Any:
    """The Linear's lowering in the form `options.int8` names."""
    int8 = options.int8

    def int8_static_linear(
        x: Any,
        wq: Any,
        w_scale: Any,
        x_scale: float,
        x_zp: int,
        bias: Any,
        post: str = "none",
        out_scale: float = 0.0,
        out_zp: int = 0,
    ) -> Any:
        from onnx_ir import DataType

        # the int8 weight transposed to [K, N]: an initializer's transpose, folded at export
        wt = op.Transpose(wq, perm=[1, 0])
        if int8 == "integer":
            if x.dtype == DataType.UINT8:
                xq = x
            else:
                s = op.Constant(value_float=float(x_scale))
                xq = op.QuantizeLinear(
                    as_float(x), s, op.Constant(value=u8(int(x_zp), scalar=True))
                )
            acc = op.MatMulInteger(xq, wt, op.Constant(value=u8(int(x_zp), scalar=True)))
            scale = op.Mul(w_scale, op.Constant(value_float=float(x_scale)))  # folded
            y = op.Mul(op.Cast(acc, to=DataType.FLOAT), scale)
        else:
            # DequantizeLinear feeding MatMul directly on both sides, per column
            if len(w_scale.shape) == 0 or w_scale.shape[0] == 1:
                w = op.DequantizeLinear(wt, op.Reshape(w_scale, ints([])))
            else:
                w = op.DequantizeLinear(wt, w_scale, axis=1)
            y = op.MatMul(static_input(x, x_scale, x_zp), w)
        if bias is not None:
            y = op.Add(y, bias)
        return static_output(y, x, post, out_scale, out_zp)

    return int8_static_linear


@lowering("opswap::int8_static_conv2d", "QuantizeLinear/DequantizeLinear + Conv (+ Relu)")
def int8_static_conv2d(
    x: Any, wq: Any, w_scale: Any, x_scale: float, x_zp: int, bias: Any,
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
    post: str, out_scale: float = 0.0, out_zp: int = 0,
) -> Any:  # fmt: skip
    y = op.Conv(
        static_input(x, x_scale, x_zp),
        qdq_weight(wq, w_scale),
        *([bias] if bias is not None else []),
        strides=list(stride),
        pads=list(padding) * 2,
        dilations=list(dilation),
        group=groups,
    )
    return static_output(y, x, post, out_scale, out_zp)
