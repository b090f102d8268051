"""opswap::softmax, log_softmax -> Softmax, LogSoftmax on the last axis; masked_softmax ->
x * scale, then Where (a bool mask) or Add (an additive one), then Softmax (float32 inside).
The backward op appears only in training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, op, to
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::softmax_backward", TRAINING_ONLY, __name__)


@lowering("opswap::softmax", "Softmax (float32 inside)")
def softmax(x: Any, dtype: int | None = None) -> Any:
    return to(op.Softmax(as_float(x), axis=-1), dtype, x)


@lowering("opswap::log_softmax", "LogSoftmax (float32 inside)")
def log_softmax(x: Any, dtype: int | None = None) -> Any:
    return to(op.LogSoftmax(as_float(x), axis=-1), dtype, x)


@lowering("opswap::masked_softmax", "Mul + Where or Add + Softmax (float32 inside)")
def masked_softmax(x: Any, mask: Any, scale: float, dtype: int | None = None) -> Any:
    from onnx_ir import DataType

    z = as_float(x)
    if scale != 1.0:
        z = op.Mul(z, op.Constant(value_float=float(scale)))
    if mask is not None and mask.dtype == DataType.BOOL:
        z = op.Where(mask, z, op.Constant(value_float=float("-inf")))
    elif mask is not None:
        z = op.Add(z, as_float(mask))
    return to(op.Softmax(z, axis=-1), dtype, x)
