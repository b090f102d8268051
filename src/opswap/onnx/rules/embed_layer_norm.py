"""onnx.embed_layer_norm: BERT's embeddings, word + token type + position lookups, two
adds and a LayerNormalization, into com.microsoft EmbedLayerNormalization: three
gathers, the sums and the norm in one pass per token. The positions must be 0..S-1 (the
exporters' slice of a constant arange), which is what the fused op computes itself."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opswap.onnx.rule import MS_DOMAIN, OnnxRule, attr_float, attr_int, const, ok, rank, refuse


def _arange_prefix(positions: ir.Value) -> str | None:
    """None when `positions` is positions 0..S-1 (a constant arange, or a slice of one
    from 0 along its last axis); else why not."""
    a = const(positions)
    if a is not None:
        flat = a.reshape(-1)
        return (
            None
            if np.array_equal(flat, np.arange(flat.size))
            else "the positions are constants other than 0..S-1"
        )
    node = positions.producer()
    if node is None or node.op_type != "Slice":
        return "the position ids are not 0..S-1 of a constant (they are an input or computed)"
    table = const(node.inputs[0])
    starts = const(node.inputs[1]) if len(node.inputs) > 1 else None
    steps = const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if table is None or starts is None:
        return "the position ids are a slice of something other than a constant"
    if table.ndim not in (1, 2) or not np.array_equal(table.reshape(-1), np.arange(table.size)):
        return "the position table is not 0, 1, 2, ..."
    if int(starts.reshape(-1)[0]) != 0 or (steps is not None and int(steps.reshape(-1)[0]) != 1):
        return "the positions do not start at 0 in steps of 1"
    return None


class EmbedLayerNorm(OnnxRule):
    name = "onnx.embed_layer_norm"
    phase = "late"
    exactness = "exact"
    description = "Gather(word) + Gather(type) + Gather(position) then LayerNormalization -> com.microsoft EmbedLayerNormalization."
    produces = ("EmbedLayerNormalization",)
    commute = True

    def pattern(self, op, ids, types, positions, word, seg, pos, gamma, beta):
        s = op.Add(op.Gather(word, ids), op.Gather(seg, types))
        s = op.Add(s, op.Gather(pos, positions))
        return op.LayerNormalization(s, gamma, beta, _allow_other_attributes=True, _outputs=["ln"])

    def check(self, context, ids, types, positions, word, seg, pos, gamma, beta, ln, **_):
        for v, what in ((word, "word"), (seg, "token type"), (pos, "position")):
            t = const(v)
            if t is None or t.ndim != 2:
                return refuse(f"the {what} embedding table is not a 2-D constant")
        if rank(ids) != 2 or rank(types) != 2:
            return refuse("the token ids are not [batch, sequence]")
        why = _arange_prefix(positions)
        if why:
            return refuse(why)
        node = ln.producer()
        if attr_int(node, "axis") not in (-1, 2):
            return refuse("the LayerNormalization is not over the hidden axis")
        if len([o for o in node.outputs if o.uses()]) > 1:
            return refuse("the LayerNormalization's mean or inverse deviation is read too")
        return ok()

    def rewrite(self, op, ids, types, word, seg, pos, gamma, beta, ln, **_):
        eps = attr_float(ln.producer(), "epsilon")
        i32 = ir.DataType.INT32
        out = op.EmbedLayerNormalization(
            op.Cast(ids, to=i32),
            op.Cast(types, to=i32),
            word,
            pos,
            seg,
            gamma,
            beta,
            epsilon=eps,
            _domain=MS_DOMAIN,
            _outputs=2,
        )
        return out[0]
