"""opswap::int8_linear -> per-row int8 quantisation, MatMulInteger, rescale; and
aten::_int_mm -> MatMulInteger (what Int8Linear traces to on VNNI CPUs).

Why not com.microsoft DynamicQuantizeMatMul: it quantises the input per tensor and
asymmetrically, opswap's op per row and symmetrically; the lowering keeps the op's
numbers (MatMulInteger multiplies the same int8 codes).
"""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op
from opswap.backends.lowerings._registry import lowering
from opswap.kernels.int8_linear import _MAX_STEP, _QMAX


@lowering("opswap::int8_linear", "MatMulInteger with per-row int8 quantisation")
def int8_linear(x: Any, wq: Any, w_scale: Any, bias: Any) -> Any:
    from onnx_ir import DataType

    # x [..., K] quantised per row: s = max|x| / 127, q = round(x / s) in [-127, 127]
    xf = as_float(x)
    amax = op.ReduceMax(op.Abs(xf), ints([-1]), keepdims=1)
    scale = op.Div(op.Max(amax, op.Constant(value_float=1e-12)), op.Constant(value_float=_QMAX))
    step = op.Min(scale, op.Constant(value_float=float(_MAX_STEP)))
    q = op.Clip(
        op.Round(op.Div(xf, step)),
        op.Constant(value_float=-_QMAX),
        op.Constant(value_float=_QMAX),
    )
    acc = op.MatMulInteger(op.Cast(q, to=DataType.INT8), wq)  # [..., N] int32
    y = op.Mul(op.Mul(op.Cast(acc, to=DataType.FLOAT), scale), w_scale)
    if bias is not None:
        y = op.Add(y, bias)
    return back(y, x)


@lowering("aten::_int_mm", "MatMulInteger")
def int_mm(a: Any, b: Any) -> Any:
    return op.MatMulInteger(a, b)
