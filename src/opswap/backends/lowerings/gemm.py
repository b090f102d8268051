"""opswap::gemm -> MatMul (the weight Transposed when it is a Linear's [N, K]), times the
FP8 scales, Add (the bias), the activation's ONNX op (Relu, Gelu erf or tanh, s *
Sigmoid(s) for SiLU), Add (the residual); float32 inside, as the op's epilogue computes
on its fp32 accumulator, then cast to the op's output dtype."""

from __future__ import annotations

from typing import Any

from opswap.backends.lowerings._onnx import as_float, back, op
from opswap.backends.lowerings._registry import lowering


def _activate(y: Any, activation: str) -> Any:
    if activation == "relu":
        return op.Relu(y)
    if activation in ("gelu", "gelu_tanh"):
        return op.Gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return op.Mul(y, op.Sigmoid(y))
    return y


@lowering("opswap::gemm", "MatMul + Add + the activation's ONNX op + Add (float32 inside)")
def gemm(
    a: Any,
    b: Any,
    bias: Any,
    residual: Any,
    activation: str,
    b_transposed: bool,
    precision: str,
    scale_a: Any = None,
    scale_b: Any = None,
) -> Any:
    from onnx_ir import DataType

    w = as_float(b)
    if b_transposed:  # a Linear weight [N, K]: the product reads it as [K, N]
        w = op.Transpose(w, perm=[1, 0])
    y = op.MatMul(as_float(a), w)
    if precision == "fp8":
        y = op.Mul(y, op.Mul(as_float(scale_a), as_float(scale_b)))
    if bias is not None:
        y = op.Add(y, as_float(bias))
    y = _activate(y, activation)
    if residual is not None:
        y = op.Add(y, as_float(residual))
    if precision == "fp8":  # e4m3 in, bfloat16 out
        return op.Cast(y, to=DataType.BFLOAT16)
    return back(y, a)
