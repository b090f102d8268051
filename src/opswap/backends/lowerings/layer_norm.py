"""opswap::layer_norm -> ReduceMean, Sub, Sqrt, Div, the weight and bias (float32 inside),
written out: LayerNormalization would also hand back its mean and 1/std. The backward op
appears only in training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::layer_norm_backward", TRAINING_ONLY, __name__)


@lowering("opswap::layer_norm", "ReduceMean + Sub + Sqrt + Div + Mul + Add (float32 inside)")
def layer_norm(x: Any, weight: Any, bias: Any, eps: float) -> Any:
    xf = as_float(x)
    mu = op.ReduceMean(xf, ints([-1]), keepdims=1)
    d = op.Sub(xf, mu)
    var = op.ReduceMean(op.Mul(d, d), ints([-1]), keepdims=1)
    y = op.Div(d, op.Sqrt(op.Add(var, op.Constant(value_float=float(eps)))))
    if weight is not None:
        y = op.Mul(y, as_float(weight))
    if bias is not None:
        y = op.Add(y, as_float(bias))
    return back(y, x)
