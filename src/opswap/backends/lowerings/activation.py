"""opswap::bias_act -> Add (the bias, when given), then the activation's ONNX op: Relu,
Clip (relu6), LeakyRelu, HardSwish, HardSigmoid, Sigmoid * s (SiLU), s * Sigmoid(1.702 s)
(quick_gelu) or Gelu (erf or tanh), float32 inside. The backward op appears only in
training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, op
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::bias_act_backward", TRAINING_ONLY, __name__)


@lowering("opswap::bias_act", "Add + the activation's ONNX op (float32 inside)")
def bias_act(x: Any, bias: Any, activation: str, negative_slope: float) -> Any:
    s = as_float(x)
    if bias is not None:
        s = op.Add(s, as_float(bias))
    if activation == "relu":
        y = op.Relu(s)
    elif activation == "relu6":
        y = op.Clip(s, op.Constant(value_float=0.0), op.Constant(value_float=6.0))
    elif activation == "leaky_relu":
        y = op.LeakyRelu(s, alpha=float(negative_slope))
    elif activation == "hardswish":
        y = op.HardSwish(s)
    elif activation == "hardsigmoid":  # relu6(s + 3) / 6 = clip(s / 6 + 1/2, 0, 1)
        y = op.HardSigmoid(s, alpha=1.0 / 6.0, beta=0.5)
    elif activation == "silu":
        y = op.Mul(s, op.Sigmoid(s))
    elif activation == "quick_gelu":
        y = op.Mul(s, op.Sigmoid(op.Mul(s, op.Constant(value_float=1.702))))
    else:
        y = op.Gelu(s, approximate="tanh" if activation == "gelu_tanh" else "none")
    return back(y, x)
