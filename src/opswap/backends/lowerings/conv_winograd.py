"""opswap::conv_winograd -> one Conv: Winograd is another route to the same convolution,
so a runtime gets the convolution and picks its own algorithm (ONNX Runtime and OpenVINO
have Winograd kernels of their own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import op
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::conv_winograd", "Conv")
def conv_winograd(
    x: Any, weight: Any, bias: Any, padding: Sequence[int], groups: int, m: int
) -> Any:
    # stride 1, dilation 1, zero padding the same on both sides of each dim (the op's
    # contract); m, the tile size, is the algorithm's choice and not the function's
    return op.Conv(
        x,
        weight,
        *([bias] if bias is not None else []),
        strides=[1, 1],
        pads=list(padding) * 2,
        dilations=[1, 1],
        group=groups,
    )
