"""opswap::row_reduce -> ReduceSum, ReduceMean or ReduceMax, the variance written out;
opswap::row_dot -> Mul + ReduceSum (float32 inside). The backward op of the sums of
squares appears only in training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::row_sumsq_backward", TRAINING_ONLY, __name__)


@lowering("opswap::row_reduce", "ReduceSum, ReduceMean or ReduceMax (float32 inside)")
def row_reduce(x: Any, op: str, unbiased: bool, keepdim: bool) -> Any:  # `op`: the schema's name
    return reduce_rows(x, op, unbiased, keepdim)


def reduce_rows(x: Any, kind: str, unbiased: bool, keepdim: bool) -> Any:
    from onnx_ir import DataType

    xf, axes, keep = as_float(x), ints([-1]), int(bool(keepdim))
    if kind == "sum":
        r = op.ReduceSum(xf, axes, keepdims=keep)
    elif kind == "mean":
        r = op.ReduceMean(xf, axes, keepdims=keep)
    elif kind == "max":
        r = op.ReduceMax(xf, axes, keepdims=keep)
    elif kind in ("sumsq", "meansq"):
        sq = op.Mul(xf, xf)
        r = (op.ReduceSum if kind == "sumsq" else op.ReduceMean)(sq, axes, keepdims=keep)
    else:  # var: the mean of squared deviations, times n / (n - 1) when unbiased
        d = op.Sub(xf, op.ReduceMean(xf, axes, keepdims=1))
        ss = op.ReduceSum(op.Mul(d, d), axes, keepdims=keep)
        n = op.Cast(op.Shape(x, start=-1), to=DataType.FLOAT)
        den = op.Sub(n, op.Constant(value_float=1.0)) if unbiased else n
        r = op.Div(ss, op.Squeeze(den))
    return back(r, x)


@lowering("opswap::row_dot", "Mul + ReduceSum (float32 inside)")
def row_dot(x: Any, y: Any, keepdim: bool) -> Any:
    xy = op.Mul(as_float(x), as_float(y))
    return back(op.ReduceSum(xy, ints([-1]), keepdims=int(bool(keepdim))), x)
