"""onnx.transpose_pair: two Transposes in a row into one (or none, when they cancel), so
that the data moves once at most; attention's key (transpose(1, 2) then transpose(2, 3))
is the usual case, and what onnx.attention then matches."""

from __future__ import annotations

from opswap.onnx.rule import OnnxRule, ok, refuse


def _perm(node) -> list[int] | None:
    a = node.attributes.get("perm")
    return None if a is None else list(a.as_ints())


class TransposePair(OnnxRule):
    name = "onnx.transpose_pair"
    phase = "early"
    exactness = "exact"
    description = (
        "Transpose(Transpose(x, p), q) -> Transpose(x, p[q]), or x when it is the identity."
    )
    produces = ("Transpose",)

    def pattern(self, op, x):
        inner = op.Transpose(x, _allow_other_attributes=True, _outputs=["inner"])
        return op.Transpose(inner, _allow_other_attributes=True, _outputs=["outer"])

    def check(self, context, x, inner, outer, **_):
        if _perm(inner.producer()) is None or _perm(outer.producer()) is None:
            return refuse("a Transpose without perm (reverse the axes) is left as it is")
        return ok()

    def rewrite(self, op, x, inner, outer, **_):
        p, q = _perm(inner.producer()), _perm(outer.producer())
        assert p is not None and q is not None
        both = [p[i] for i in q]
        if both == list(range(len(both))):
            return op.Identity(x)
        return op.Transpose(x, perm=both)
