"""opswap::conv_onednn -> Conv: the same convolution (the prepacked weight is an eager-PyTorch
choice; an ONNX runtime packs its own weights when it loads the model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import conv
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::conv_onednn", "Conv")
def conv_onednn(
    x: Any,
    weight: Any,
    bias: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Any:
    return conv(x, weight, bias, stride, padding, dilation, groups)
