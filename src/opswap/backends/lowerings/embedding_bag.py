"""opswap::batched_embedding_bag -> Gather of the rows (indices plus each table's first
row), the int8 dequantization (Gather of scale and bias, Mul, Add) or the cast to float32,
the per-sample weights (Mul), then ReduceSum or ReduceMean over the bag axis."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, ints, op, to
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::batched_embedding_bag", "Gather + (dequantize) + ReduceSum / ReduceMean")
def batched_embedding_bag(
    weight: Any,
    offsets: Any,
    indices: Any,
    per_sample_weights: Any,
    mean: bool,
    scale: Any,
    bias: Any,
    out_dtype: int | None = None,
) -> Any:
    rows = op.Add(indices, op.Unsqueeze(offsets, ints([0, 2])))  # [B, T, L]
    vals = as_float(op.Gather(weight, rows, axis=0))  # [B, T, L, D]
    if scale is not None and bias is not None:
        s = op.Unsqueeze(op.Gather(scale, rows, axis=0), ints([-1]))
        b = op.Unsqueeze(op.Gather(bias, rows, axis=0), ints([-1]))
        vals = op.Add(op.Mul(vals, s), b)
    if per_sample_weights is not None:
        vals = op.Mul(vals, op.Unsqueeze(as_float(per_sample_weights), ints([-1])))
    pooled = (op.ReduceMean if mean else op.ReduceSum)(vals, ints([2]), keepdims=0)
    if out_dtype is None and scale is not None:
        return pooled  # an int8 table's output is float32
    return to(pooled, out_dtype, weight)
