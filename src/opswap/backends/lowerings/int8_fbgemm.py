"""opswap::int8_linear_fbgemm -> per-tensor 7-bit uint8 quantisation, MatMulInteger,
rescale (the op's own math; DynamicQuantizeLinear would use all 8 bits)."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, op
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::int8_linear_fbgemm", "MatMulInteger with per-tensor 7-bit uint8 quantisation")
def int8_linear_fbgemm(x: Any, wq: Any, w_scale: Any, bias: Any) -> Any:
    from onnx_ir import DataType

    # x quantised per tensor to [0, 127]: s = (max(x, 0) - min(x, 0)) / 127,
    # zp = clamp(round(-lo / s), 0, 127), q = clamp(round(x / s) + zp, 0, 127);
    # DynamicQuantizeLinear would use all 8 bits, which is not the op's math
    xf = as_float(x)
    zero = op.Constant(value_float=0.0)
    top = op.Constant(value_float=127.0)
    lo = op.Min(op.ReduceMin(xf, keepdims=0), zero)
    hi = op.Max(op.ReduceMax(xf, keepdims=0), zero)
    scale = op.Max(op.Div(op.Sub(hi, lo), top), op.Constant(value_float=1e-12))
    zp = op.Clip(op.Round(op.Div(op.Neg(lo), scale)), zero, top)
    q = op.Clip(op.Add(op.Round(op.Div(xf, scale)), zp), zero, top)
    acc = op.MatMulInteger(
        op.Cast(q, to=DataType.UINT8), wq, op.Cast(zp, to=DataType.UINT8)
    )  # [..., N] int32, the zero point taken off by MatMulInteger
    y = op.Mul(op.Mul(op.Cast(acc, to=DataType.FLOAT), scale), w_scale)
    if bias is not None:
        y = op.Add(y, bias)
    return back(y, x)
