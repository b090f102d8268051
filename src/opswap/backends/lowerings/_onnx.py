"""What the lowerings share: the ONNX opset they write in (imported on first use, since
onnx and onnxscript are an optional install) and the dtype conversions around the ops'
float32 math."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx_ir as ir

OPSET = 20  # the exporter's default in torch 2.13; Cast to float8 needs >= 19

# Any, in the lowerings: an onnxscript value (a tensor of the op as the exporter traces it,
# or what an `op.X` call returns), whose type lives in onnxscript, an optional install.
# torch.onnx reads a lowering's annotations (typing.get_type_hints): `Any` and no
# annotation both make a parameter an input, an int, float, str or bool one an attribute,
# so every annotation of a registered lowering must also evaluate at run time.


class _Opset:
    """onnxscript's opset OPSET (`op.Relu(x)`, ...), imported when first used."""

    def __getattr__(self, name: str) -> Any:
        import onnxscript

        return getattr(getattr(onnxscript, f"opset{OPSET}"), name)


op: Any = _Opset()


def ints(v: Iterable[int]) -> Any:
    """A constant int64 list: the axes or shape `v`."""
    return op.Constant(value_ints=[int(i) for i in v])


def as_float(x: Any) -> Any:
    """x as float32 (the ops compute in float32, as their CPU kernels do)."""
    from onnx_ir import DataType

    return x if x.dtype == DataType.FLOAT else op.Cast(x, to=DataType.FLOAT)


def back(y: Any, x: Any) -> Any:
    """y in x's dtype."""
    from onnx_ir import DataType

    return y if x.dtype == DataType.FLOAT else op.Cast(y, to=x.dtype)


def to(y: Any, dtype: int | None, like: Any) -> Any:
    """y in `dtype` (an ONNX data type, onnx_ir.DataType: an int enum; None: like's dtype)."""
    if dtype is None:
        return back(y, like)
    from onnx_ir import DataType

    return y if dtype == DataType.FLOAT else op.Cast(y, to=dtype)


def promoted(y: Any, a: Any, b: Any) -> Any:
    """y in torch's promotion of a's and b's float dtypes."""
    from onnx_ir import DataType

    if a.dtype == b.dtype:
        return back(y, a)
    if DataType.DOUBLE in (a.dtype, b.dtype):
        return op.Cast(y, to=DataType.DOUBLE)
    if DataType.FLOAT in (a.dtype, b.dtype):
        return y
    return y  # float16 with bfloat16 promotes to float32


def u8(v: int, scalar: bool = False) -> ir.TensorProtocol:
    """A uint8 constant tensor (0-d when `scalar`, else one element)."""
    import numpy as np
    import onnx_ir as ir

    return ir.tensor(np.array(v if scalar else [v], dtype=np.uint8))


def conv(
    x: Any,
    weight: Any,
    bias: Any,
    stride: Iterable[int],
    padding: Iterable[int],
    dilation: Iterable[int],
    groups: int,
) -> Any:
    """ONNX `Conv` of an opswap conv op whose contract is PyTorch's conv with zero padding,
    the same on both sides of each spatial dim (the conv algorithms and conv_relu)."""
    return op.Conv(
        x,
        weight,
        *([bias] if bias is not None else []),
        strides=list(stride),
        pads=list(padding) * 2,
        dilations=list(dilation),
        group=groups,
    )
