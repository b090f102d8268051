"""onnx.attention: multi-head attention written out on [batch, heads, seq, head_dim] tensors
(split heads with Reshape + Transpose, MatMul, scale, optional additive mask, Softmax,
MatMul, merge heads) into one com.microsoft MultiHeadAttention on the [batch, seq, hidden]
projections: the [seq, seq] scores never round-trip through memory between five kernels.

The projections' biases (MatMul + b before each head split) go into MHA's bias input.
The mask, when there is one, becomes MHA's attention_bias, broadcast to [batch or 1, 1,
seq, kv_seq] as MHA requires; the scale is read from the constant. The head count comes
from the head-split Reshape's constant shape ([batch, seq, -1 or heads, head_dim]).
"""

from __future__ import annotations

from opswap.onnx.rule import MS_DOMAIN, OnnxRule, attr_int, bias_of, const, ok, rank, refuse, scalar

_SPLIT = [0, 2, 1, 3]  # [B, S, N, H] -> [B, N, S, H], and back
_KEY = [0, 2, 3, 1]  # [B, S, N, H] -> [B, N, H, S]


def _perm(value) -> list[int] | None:
    a = value.producer().attributes.get("perm")
    return None if a is None else list(a.as_ints())


def _shape_const(value) -> list[int] | None:
    """The Reshape target as ints: a constant, or a Concat whose last two parts are."""
    a = const(value)
    if a is not None:
        return [int(v) for v in a.reshape(-1)]
    node = value.producer()
    if node is None or node.op_type != "Concat" or len(node.inputs) < 2:
        return None
    parts = [const(v) for v in node.inputs]
    tail = [p for p in parts[-2:] if p is not None]
    if len(tail) < 2 or any(p.size != 1 for p in tail):
        last = parts[-1]
        return None if last is None or last.size != 2 else [-9, -9, *map(int, last.reshape(-1))]
    return [-9] * (len(parts) - 2) + [int(p.reshape(-1)[0]) for p in tail]


def heads(shape_value, hidden) -> tuple[int, int] | str:
    """(heads, head_dim) from a head-split Reshape's target shape, or why not."""
    shape = _shape_const(shape_value)
    if shape is None or len(shape) != 4:
        return "the head split's shape is not a constant [batch, seq, heads, head_dim]"
    n, h = shape[2], shape[3]
    if h <= 0:
        return "the head size is not a constant"
    if n <= 0:
        if not isinstance(hidden, int):
            return "the hidden size is not known, so neither is the head count"
        n = hidden // h
    if isinstance(hidden, int) and n * h != hidden:
        return f"{n} heads of {h} do not make the hidden size {hidden}"
    return n, h


class Attention(OnnxRule):
    name = "onnx.attention"
    # after the norms and activations, the order plans have always run them in
    after = ("onnx.fast_gelu",)
    exactness = "exact"
    description = (
        "Split heads, Q K^T, scale, [mask], Softmax, x V, merge heads -> "
        "com.microsoft MultiHeadAttention."
    )
    produces = ("MultiHeadAttention",)
    variants = 4  # scale by Mul or Div; with or without an additive mask

    def pattern(self, op, q3, k3, v3, qs, ks, vs, c, mask, os):
        q = op.Transpose(
            op.Reshape(q3, qs, _allow_other_attributes=True),
            _allow_other_attributes=True,
            _outputs=["qt"],
        )
        k = op.Transpose(
            op.Reshape(k3, ks, _allow_other_attributes=True),
            _allow_other_attributes=True,
            _outputs=["kt"],
        )
        v = op.Transpose(
            op.Reshape(v3, vs, _allow_other_attributes=True),
            _allow_other_attributes=True,
            _outputs=["vt"],
        )
        s = op.MatMul(q, k)
        s = op.Mul(s, c) if self.variant % 2 == 0 else op.Div(s, c)
        if self.variant >= 2:
            s = op.Add(s, mask)
        p = op.Softmax(s, _allow_other_attributes=True, _outputs=["probs"])
        ctx = op.Transpose(op.MatMul(p, v), _allow_other_attributes=True, _outputs=["merged"])
        return op.Reshape(ctx, os, _allow_other_attributes=True)

    def check(
        self, context, q3, k3, v3, qs, ks, vs, c, qt, kt, vt, probs, merged, os, mask=None, **_
    ):
        for t, want, what in (
            (qt, _SPLIT, "query"),
            (kt, _KEY, "key"),
            (vt, _SPLIT, "value"),
            (merged, _SPLIT, "output"),
        ):
            if _perm(t) != want:
                return refuse(f"the {what}'s transpose is {_perm(t)}, not {want}")
        for t, what in ((q3, "query"), (k3, "key"), (v3, "value")):
            if rank(t) != 3:
                return refuse(f"the {what} projection has rank {rank(t)}, not [batch, seq, hidden]")
        axis = attr_int(probs.producer(), "axis")
        if axis not in (-1, 3):
            return refuse(f"the Softmax is over axis {axis}, not the keys")
        if scalar(c) is None or scalar(c) == 0:
            return refuse("the scores' scale is not a constant")
        found = [heads(s, t.shape[-1]) for s, t in ((qs, q3), (ks, k3), (vs, v3))]
        for f in found:
            if isinstance(f, str):
                return refuse(f)
        if len(set(found)) != 1:
            return refuse(f"query, key and value split into different heads: {found}")
        length = list(os.shape) if os.shape is not None else None  # the shape's own shape
        if length != [3]:
            return refuse("the merged heads are not reshaped back to [batch, seq, hidden]")
        if mask is not None:
            r = rank(mask)
            if r is None or r > 4:
                return refuse(f"the mask has rank {r}; MultiHeadAttention takes at most 4")
            n = found[0][0]  # type: ignore[index]
            if r == 4 and isinstance(mask.shape[1], int) and mask.shape[1] not in (1, n):
                return refuse(f"the mask has {mask.shape[1]} rows of heads, neither 1 nor {n}")
            if mask.dtype != q3.dtype:
                return refuse(f"the mask is {mask.dtype}, not the scores' {q3.dtype}")
        return ok()

    def rewrite(self, op, q3, k3, v3, qs, c, mask=None, **_):
        found = heads(qs, q3.shape[-1])
        assert not isinstance(found, str)
        scale = scalar(c)
        assert scale is not None
        bias = None
        if mask is not None:
            one = op.Constant(value_ints=[1])
            two = op.Constant(value_ints=[2])
            s = op.Slice(op.Shape(q3), one, two)
            kv = op.Slice(op.Shape(k3), one, two)
            lead = op.Constant(value_ints=[1, 1])
            want = op.Concat(lead, s, kv, axis=0)
            r = rank(mask) or 0  # a lower-rank mask lines up with the scores' trailing axes
            m = mask if r == 4 else op.Unsqueeze(mask, op.Constant(value_ints=list(range(4 - r))))
            bias = op.Expand(m, want)
        qkv = [bias_of(t) for t in (q3, k3, v3)]
        packed = None
        if all(f is not None for f in qkv):  # the projections' biases, added inside MHA
            q3, k3, v3 = (f[0] for f in qkv)  # type: ignore[index]
            packed = op.Concat(*(f[1] for f in qkv), axis=0)  # type: ignore[index]
        return op.MultiHeadAttention(
            q3,
            k3,
            v3,
            packed,
            None,
            bias,
            num_heads=found[0],
            scale=scale if self.variant % 2 == 0 else 1.0 / scale,
            _domain=MS_DOMAIN,
        )
