"""aten::_addmm_activation (what the rule activation.linear_epilogue leaves) -> MatMul,
Add (float32), Relu or Gelu(approximate="tanh").

The op has a decomposition the exporter would use, traced on the CPU, where the op's
GELU is the erf form; on CUDA, the device the rule targets, it is the tanh form
(Blas.cpp and the decomposition itself branch on the device). The rule folds only a
tanh-GELU, so the lowering writes the tanh form: the ONNX file computes the user's
function on every execution provider.
"""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, op
from opswap.backends.lowerings._registry import lowering


@lowering("aten::_addmm_activation", "MatMul + Add + Relu or Gelu(tanh) (float32 inside)")
def addmm_activation(
    bias: Any, mat1: Any, mat2: Any, beta: float = 1.0, alpha: float = 1.0, use_gelu: bool = False
) -> Any:
    # bias [N], mat1 [M, K], mat2 [K, N]; the epilogue's math on the fp32 accumulator
    y = as_float(op.MatMul(mat1, mat2))
    b = as_float(bias)
    if alpha != 1.0:
        y = op.Mul(y, op.Constant(value_float=float(alpha)))
    if beta != 1.0:
        b = op.Mul(b, op.Constant(value_float=float(beta)))
    y = op.Add(y, b)
    y = op.Gelu(y, approximate="tanh") if use_gelu else op.Relu(y)
    return back(y, mat1)
