"""opswap::conv_nnpack -> Conv: the same convolution (NNPACK is an eager-PyTorch route; an
ONNX runtime picks its own algorithm)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import conv
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::conv_nnpack", "Conv")
def conv_nnpack(
    x: Any,
    weight: Any,
    bias: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Any:
    return conv(x, weight, bias, stride, padding, dilation, groups)
