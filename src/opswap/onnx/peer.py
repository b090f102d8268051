"""The peer: ONNX Runtime's own transformer optimizer
(`onnxruntime.transformers.optimizer.optimize_model`), run on the same file, and what it
fused (`get_fused_operator_statistics`), for `opswap optimize` to race and for the
comparison of fusion counts."""

from __future__ import annotations

import contextlib
import io
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

#: op types ORT's statistics count, each with the fused op types that contain it
#: (a SkipLayerNormalization is a LayerNormalization with the residual add fused in)
CONTAINS: dict[str, tuple[str, ...]] = {
    "LayerNormalization": ("SkipLayerNormalization",),
    "SimplifiedLayerNormalization": ("SkipSimplifiedLayerNormalization",),
    "Gelu": ("BiasGelu",),
    "Attention": ("MultiHeadAttention",),
}


def ort_optimize(
    proto: onnx.ModelProto, model_type: str = "bert", num_heads: int = 0, hidden_size: int = 0
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """ORT's transformer optimizer on `proto`, with its defaults as a user runs it; the model
    and its fused-operator counts. Its log goes quiet."""
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    mine = onnx.ModelProto()
    mine.CopyFrom(proto)  # the optimizer changes the proto it is given

    quiet = logging.getLogger("onnxruntime.transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            opt = optimize_model(
                mine, model_type=model_type, num_heads=num_heads, hidden_size=hidden_size
            )
        stats = {k: int(v) for k, v in opt.get_fused_operator_statistics().items()}
    finally:
        quiet.setLevel(level)
    return opt.model, stats


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in proto.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def covers(ours: dict[str, int], theirs: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each fused kind the peer made at least once: (our count, with the fused ops that
    contain it, and the peer's count); short where ours is below theirs."""
    out = {}
    for kind, n in theirs.items():
        if n:
            out[kind] = (ours.get(kind, 0) + sum(ours.get(k, 0) for k in CONTAINS.get(kind, ())), n)
    return out
