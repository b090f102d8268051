"""opswap::conv_relu -> Conv + Relu (ONNX Runtime fuses the pair into its FusedConv)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import conv, op
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::conv_relu", "Conv + Relu")
def conv_relu(
    x: Any,
    weight: Any,
    bias: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Any:
    return op.Relu(conv(x, weight, bias, stride, padding, dilation, groups))
