"""opswap::rms_norm -> ReduceMean of squares, Sqrt, Div, the weight (float32 inside);
opswap::add_rms_norm -> Add, then the same, handing back both the normed row and the sum.
Their backward op appears only in training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::rms_norm_backward", TRAINING_ONLY, __name__)


def rms(s: Any, like: Any, weight: Any, eps: float, offset: float, cast_first: bool) -> Any:
    """The kernels' math: h = s / sqrt(mean(s^2) + eps) in float32, then the weight
    (+ offset); the output's dtype as the op's (promoted when cast_first)."""
    from onnx_ir import DataType

    sf = as_float(s)
    ms_ = op.ReduceMean(op.Mul(sf, sf), ints([-1]), keepdims=1)
    h = op.Div(sf, op.Sqrt(op.Add(ms_, op.Constant(value_float=float(eps)))))
    if weight is None:
        return back(h, like)
    w = as_float(weight)
    if offset:
        w = op.Add(w, op.Constant(value_float=float(offset)))
    y = op.Mul(h, w)
    wide = cast_first and weight.dtype == DataType.FLOAT
    return y if wide else back(y, like)


@lowering("opswap::rms_norm", "ReduceMean + Sqrt + Div + Mul (float32 inside)")
def rms_norm(x: Any, weight: Any, eps: float, offset: float, cast_first: bool) -> Any:
    return rms(x, x, weight, eps, offset, cast_first)


@lowering("opswap::add_rms_norm", "Add + the rms_norm lowering")
def add_rms_norm(
    x: Any, residual: Any, weight: Any, eps: float, offset: float, cast_first: bool
) -> tuple[Any, Any]:
    s = op.Add(x, residual)
    return rms(s, x, weight, eps, offset, cast_first), s
