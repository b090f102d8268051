"""opswap::flash_attention -> q kᵀ scale, the hidden keys at -inf (Where: causal, key
lengths, a bool mask; an additive mask Added), Softmax, · v; and the log-sum-exp. The
backward op appears only in training graphs, which are not exported."""

from __future__ import annotations

from typing import Any  # onnxscript values: see _onnx

from opswap.backends.lowerings._onnx import as_float, back, ints, op
from opswap.backends.lowerings._registry import TRAINING_ONLY, lowering, no_lowering

no_lowering("opswap::flash_attention_backward", TRAINING_ONLY, __name__)


def _hidden(q: Any, k: Any, causal: bool, lengths: Any, mask: Any) -> Any:
    """The keys each query may see ([.., S_q, S_k] bool; None: all of them)."""
    from onnx_ir import DataType

    keep = None
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    keys = op.Range(zero, op.Squeeze(op.Shape(k, start=2, end=3)), one)  # [S_k]
    if causal:  # top-left aligned: query i sees keys j <= i
        rows = op.Range(zero, op.Squeeze(op.Shape(q, start=2, end=3)), one)
        keep = op.LessOrEqual(op.Unsqueeze(keys, ints([0])), op.Unsqueeze(rows, ints([1])))
    if lengths is not None:  # [B] -> [B, 1, 1, S_k]
        seen = op.Less(
            op.Unsqueeze(keys, ints([0])),
            op.Unsqueeze(op.Cast(lengths, to=DataType.INT64), ints([1])),
        )
        seen = op.Unsqueeze(seen, ints([1, 2]))
        keep = seen if keep is None else op.And(keep, seen)
    if mask is not None and mask.dtype == DataType.BOOL:
        keep = mask if keep is None else op.And(keep, mask)
    return keep


@lowering("opswap::flash_attention", "MatMul + Where (causal, lengths, mask) + Softmax + MatMul")
def flash_attention(
    q: Any, k: Any, v: Any, causal: bool, scale: float, lengths: Any, mask: Any
) -> tuple[Any, Any]:
    from onnx_ir import DataType

    h, hk, d = q.shape[1], k.shape[1], k.shape[3]
    qf, kf, vf = as_float(q), as_float(k), as_float(v)
    if hk != h:  # GQA: each kv head repeated for its h / hk query heads
        rep = ints([1, 1, h // hk, 1, 1])
        kf, vf = (
            op.Reshape(op.Expand(op.Unsqueeze(t, ints([2])), rep), ints([0, h, -1, d]))
            for t in (kf, vf)
        )
    s = op.Mul(
        op.MatMul(qf, op.Transpose(kf, perm=[0, 1, 3, 2])),
        op.Constant(value_float=float(scale)),
    )
    keep = _hidden(q, k, causal, lengths, mask)
    if mask is not None and mask.dtype != DataType.BOOL:
        s = op.Add(s, as_float(mask))
    ninf = op.Constant(value_float=float("-inf"))
    if keep is not None:
        s = op.Where(keep, s, ninf)
    p = op.Softmax(s, axis=-1)
    zf = op.Constant(value_float=0.0)
    p = op.Where(op.IsNaN(p), zf, p)  # a row that sees no key: 0, as the op
    o = back(op.MatMul(p, vf), q)
    lse = op.ReduceLogSumExp(s, ints([-1]), keepdims=0)
    lse = op.Where(op.Or(op.IsNaN(lse), op.IsInf(lse)), zf, lse)
    return o, lse
