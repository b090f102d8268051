"""opswap::bias_gelu_cuda (the CUDA C++ kernel) -> Add, Gelu (erf) in float32. The
backward op appears only in training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, op
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::bias_gelu_cuda_backward", TRAINING_ONLY, __name__)


@lowering("opswap::bias_gelu_cuda", "Add + Gelu (float32 inside)")
def bias_gelu_cuda(x: Any, b: Any) -> Any:
    return back(op.Gelu(op.Add(as_float(x), as_float(b))), x)
