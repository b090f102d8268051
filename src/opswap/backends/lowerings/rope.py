"""opswap::rope -> x cos + rot(x) sin for q and k, the rotation by Split/Concat (HF's
halves or GPT-J's pairs), the tables' rows Gathered at the positions when given. The
backward op appears only in training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, ints, op, promoted
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::rope_backward", TRAINING_ONLY, __name__)


def rotate(x: Any, interleaved: bool) -> Any:
    """HF's rotate_half (-x2, x1), or GPT-J's pairs (-x_odd, x_even); x is [B, H, S, D]."""
    if not interleaved:
        a, b = op.Split(x, axis=-1, num_outputs=2)
        return op.Concat(op.Neg(b), a, axis=-1)
    pairs = op.Reshape(x, ints([0, 0, 0, -1, 2]))
    a, b = op.Split(pairs, axis=-1, num_outputs=2)
    return op.Reshape(op.Concat(op.Neg(b), a, axis=-1), ints([0, 0, 0, -1]))


@lowering("opswap::rope", "Mul + Split/Concat (the rotation) + Add, for q and k")
def rope(q: Any, k: Any, cos: Any, sin: Any, positions: Any, interleaved: bool) -> tuple[Any, Any]:
    c, s = as_float(cos), as_float(sin)
    if positions is not None:  # the tables' rows at the positions: [S, D] or [B, S, D]
        c, s = op.Gather(c, positions, axis=0), op.Gather(s, positions, axis=0)
    rank = len(cos.shape) if positions is None else len(positions.shape) + 1
    if rank == 2:  # [S, D] -> [1, 1, S, D]; [B, S, D] -> [B, 1, S, D]
        c, s = op.Unsqueeze(c, ints([0, 1])), op.Unsqueeze(s, ints([0, 1]))
    elif rank == 3:
        c, s = op.Unsqueeze(c, ints([1])), op.Unsqueeze(s, ints([1]))
    out = []
    for x in (q, k):
        xf = as_float(x)
        y = op.Add(op.Mul(xf, c), op.Mul(rotate(xf, interleaved), s))
        out.append(promoted(y, x, cos))
    return out[0], out[1]
