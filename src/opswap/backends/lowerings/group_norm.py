"""opswap::group_norm -> Reshape to [N, G, -1], the statistics as layer_norm's, then the
channels' weight and bias (float32 inside). The backward op appears only in training
graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::group_norm_backward", TRAINING_ONLY, __name__)


@lowering(
    "opswap::group_norm",
    "Reshape + ReduceMean + Sub + Sqrt + Div + Mul + Add (float32 inside)",
)
def group_norm(x: Any, num_groups: int, weight: Any, bias: Any, eps: float) -> Any:
    # [N, C, *spatial] -> [N, G, rest]: the statistics; back to [N, C, rest] for the
    # channels' affine (whatever the rank, no spatial dims included), then x's shape
    xf = as_float(x)
    shape = op.Shape(xf)
    g = op.Reshape(xf, ints([0, num_groups, -1]))
    mu = op.ReduceMean(g, ints([-1]), keepdims=1)
    d = op.Sub(g, mu)
    var = op.ReduceMean(op.Mul(d, d), ints([-1]), keepdims=1)
    y = op.Div(d, op.Sqrt(op.Add(var, op.Constant(value_float=float(eps)))))
    if weight is not None or bias is not None:
        y = op.Reshape(op.Reshape(y, shape), ints([0, 0, -1]))
        if weight is not None:
            y = op.Mul(y, op.Reshape(as_float(weight), ints([-1, 1])))
        if bias is not None:
            y = op.Add(y, op.Reshape(as_float(bias), ints([-1, 1])))
    return back(op.Reshape(y, shape), x)
