"""opswap::conv_fft -> Conv: the same stride-1 convolution (an ONNX runtime picks its own
algorithm; ONNX's DFT op would spell the FFT route, but no runtime opswap exports to runs
it faster than its Conv)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import op
from opswap.backends.lowerings._registry import lowering


@lowering("opswap::conv_fft", "Conv")
def conv_fft(x: Any, weight: Any, bias: Any, padding: Sequence[int], groups: int) -> Any:
    # stride 1, dilation 1, zero padding the same on both sides (the op's contract)
    return op.Conv(
        x,
        weight,
        *([bias] if bias is not None else []),
        pads=list(padding) * 2,
        group=groups,
    )
