"""What the lowerings share: the ONNX opset they write in (imported on first use, since
onnx and onnxscript are an optional install) and the dtype conversions around the ops'
float32 math."""

from __future__ import annotations

from typing import Any

OPSET = 20  # the exporter's default in torch 2.13; Cast to float8 needs >= 19


class _Opset:
    """onnxscript's opset OPSET (`op.Relu(x)`, ...), imported when first used."""

    def __getattr__(self, name: str) -> Any:
        import onnxscript

        return getattr(getattr(onnxscript, f"opset{OPSET}"), name)


op: Any = _Opset()


def ints(v) -> Any:
    """A constant int64 list: the axes or shape `v`."""
    return op.Constant(value_ints=[int(i) for i in v])


def as_float(x):
    """x as float32 (the ops compute in float32, as their CPU kernels do)."""
    from onnx_ir import DataType

    return x if x.dtype == DataType.FLOAT else op.Cast(x, to=DataType.FLOAT)


def back(y, x):
    """y in x's dtype."""
    from onnx_ir import DataType

    return y if x.dtype == DataType.FLOAT else op.Cast(y, to=x.dtype)


def to(y, dtype, like):
    """y in `dtype` (an ONNX data type; None: like's dtype)."""
    if dtype is None:
        return back(y, like)
    from onnx_ir import DataType

    return y if dtype == DataType.FLOAT else op.Cast(y, to=dtype)


def promoted(y, a, b):
    """y in torch's promotion of a's and b's float dtypes."""
    from onnx_ir import DataType

    if a.dtype == b.dtype:
        return back(y, a)
    if DataType.DOUBLE in (a.dtype, b.dtype):
        return op.Cast(y, to=DataType.DOUBLE)
    if DataType.FLOAT in (a.dtype, b.dtype):
        return y
    return y  # float16 with bfloat16 promotes to float32


def u8(v: int, scalar: bool = False):
    """A uint8 constant tensor (0-d when `scalar`, else one element)."""
    import numpy as np
    import onnx_ir as ir

    return ir.tensor(np.array(v if scalar else [v], dtype=np.uint8))
