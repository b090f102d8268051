"""opswap::fp8_linear -> Cast to FLOAT8E4M3FN and back (the op's CPU math), MatMul."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::fp8_linear", "Cast to FLOAT8E4M3FN and back + MatMul")
def fp8_linear(x: Any, wq: Any, w_scale: Any, bias: Any, rowwise: bool) -> Any:
    from onnx_ir import DataType

    # x / s in e4m3 (saturating at 448), s = max|x| / 448 per row or per tensor
    xf = as_float(x)
    axes = ints([-1]) if rowwise else None
    amax = op.ReduceMax(op.Abs(xf), *([axes] if axes is not None else []), keepdims=1)
    sx = op.Div(op.Max(amax, op.Constant(value_float=1e-12)), op.Constant(value_float=448.0))
    xq = op.Cast(op.Cast(op.Div(xf, sx), to=DataType.FLOAT8E4M3FN), to=DataType.FLOAT)
    w = op.Transpose(op.Cast(wq, to=DataType.FLOAT), perm=[1, 0])
    y = op.Mul(op.MatMul(xq, w), sx)
    y = op.Mul(y, op.Unsqueeze(w_scale, ints([0])) if rowwise else w_scale)
    if bias is not None:
        y = op.Add(y, as_float(bias))
    return back(y, x)
