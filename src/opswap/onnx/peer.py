"""The peer: ONNX Runtime's own transformer optimizer
(`onnxruntime.transformers.optimizer.optimize_model`), run on the same file, and what it
fused (`get_fused_operator_statistics`), for `opswap optimize` to race and for the
comparison of fusion counts; and whether it applies to a model at all (`applies`)."""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path
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
    """ORT's transformer optimizer on `proto`, with its defaults as a user runs it: on a
    file, as its command line does (handed a ModelProto, it moves every initializer out of
    the model for its session, and then cannot infer the shapes of a Slice whose starts
    are initializers, as in torch.onnx's dynamo exports); the model and its fused-operator
    counts. Its log goes quiet."""
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    quiet = logging.getLogger("onnxruntime.transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="opswap-peer-") as d:
            path = Path(d) / "model.onnx"
            big = proto.ByteSize() > _EXTERNAL_BYTES
            onnx.save(proto, str(path), save_as_external_data=big, location="model.onnx.data")
            with contextlib.redirect_stdout(io.StringIO()):
                opt = optimize_model(
                    str(path), model_type=model_type, num_heads=num_heads, hidden_size=hidden_size
                )
            stats = {k: int(v) for k, v in opt.get_fused_operator_statistics().items()}
    finally:
        quiet.setLevel(level)
    return opt.model, stats  # its data files were read in before they went


#: past this size a model is written with its tensors in a data file (protobuf's 2 GB)
_EXTERNAL_BYTES = 1_800_000_000

#: op types that mark a transformer block, what the optimizer's model types are written for
_TRANSFORMER_OPS = {
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    "SkipLayerNormalization",
    "EmbedLayerNormalization",
    "Attention",
    "MultiHeadAttention",
    "GroupQueryAttention",
}


def applies(proto: onnx.ModelProto) -> str | None:
    """None when the model has what ORT's transformer optimizer fuses (a LayerNorm, fused
    or written out, or attention: a Softmax over a MatMul's product); else why not."""
    ops = {n.op_type for n in proto.graph.node}
    if ops & _TRANSFORMER_OPS:
        return None
    if "ReduceMean" in ops and ops & {"Sqrt", "Pow"}:
        return None  # a LayerNorm or RMSNorm written out
    made = {o: n for n in proto.graph.node for o in n.output}
    for n in proto.graph.node:
        if n.op_type != "Softmax" or not n.input:
            continue
        node, hops = made.get(n.input[0]), 0
        while node is not None and hops < 4:  # scale, mask, reshape between
            if node.op_type in ("MatMul", "Einsum"):
                return None
            node, hops = (made.get(node.input[0]) if node.input else None), hops + 1
    return (
        "it has no attention and no LayerNorm, the blocks the optimizer's model types "
        "(bert, gpt2, vit, ...) are written for"
    )


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
