"""opswap::conv_nnpack -> Conv: the same convolution (NNPACK is an eager-PyTorch route; an
ONNX runtime picks its own algorithm)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import op
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
    # zero padding, the same on both sides of each spatial dim (the op's contract)
    return op.Conv(
        x,
        weight,
        *([bias] if bias is not None else []),
        strides=list(stride),
        pads=list(padding) * 2,
        dilations=list(dilation),
        group=groups,
    )
