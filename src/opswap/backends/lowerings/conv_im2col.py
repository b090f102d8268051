"""opswap::conv_im2col -> Conv: the same convolution (ONNX runtimes pick their own algorithm;
the unfold + GEMM route is an eager-PyTorch choice)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import conv
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::conv_im2col", "Conv")
def conv_im2col(
    x: Any,
    weight: Any,
    bias: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Any:
    return conv(x, weight, bias, stride, padding, dilation, groups)
