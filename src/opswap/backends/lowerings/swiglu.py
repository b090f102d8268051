"""opswap::glu and opswap::glu_packed -> Sigmoid * g (SiLU) or Gelu (erf or tanh), times u;
the packed form Splits its input into g and u first (float32 inside). Their backward ops
appear only in training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, op
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::glu_backward", TRAINING_ONLY, __name__)
no_lowering("opswap::glu_packed_backward", TRAINING_ONLY, __name__)


def act_mul(g: Any, u: Any, like: Any, activation: str) -> Any:
    """act(g) * u in `like`'s dtype (`like`: a graph input of the op's dtype; Split's
    outputs carry none while traced)."""
    gf, uf = as_float(g), as_float(u)
    if activation == "silu":
        a = op.Mul(gf, op.Sigmoid(gf))
    else:
        a = op.Gelu(gf, approximate="tanh" if activation == "gelu_tanh" else "none")
    return back(op.Mul(a, uf), like)


@lowering("opswap::glu", "Sigmoid or Gelu + Mul")
def glu(g: Any, u: Any, activation: str) -> Any:
    return act_mul(g, u, g, activation)


@lowering("opswap::glu_packed", "Split + Sigmoid or Gelu + Mul")
def glu_packed(x: Any, activation: str) -> Any:
    g, u = op.Split(x, axis=-1, num_outputs=2)
    return act_mul(g, u, x, activation)
