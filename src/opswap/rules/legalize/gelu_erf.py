"""legalize.gelu_erf: GELU written out, 0.5 * x * (1 + erf(x / sqrt(2))), -> one GELU op,
which XNNPACK delegates (it has no erf)."""

from __future__ import annotations

import math

import torch.fx as fx

from opswap.graph.ops import op_kind
from opswap.rules._edits import replace_with
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.legalize._base import Legalize
from opswap.rules.registry import register
from opswap.targets.base import Target

_RT2 = math.sqrt(2.0)


def _close(v: object, want: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v - want) < 1e-6


def _other(node: fx.Node, one: object) -> object:
    """The operand of a binary node other than `one` (None unless it has two)."""
    a = list(node.args[:2])
    if len(a) != 2 or one not in a:
        return None
    return a[1] if a[0] is one else a[0]


def _only_reader(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _scaled_input(node: object) -> fx.Node | None:
    """x for x / sqrt(2) or x * (1 / sqrt(2)), else None."""
    if not isinstance(node, fx.Node):
        return None
    kind, a = op_kind(node), list(node.args[:2])
    if kind == "div" and len(a) == 2 and isinstance(a[0], fx.Node) and _close(a[1], _RT2):
        return a[0]
    if kind == "mul" and len(a) == 2:
        for i in (0, 1):
            got = a[i]
            if isinstance(got, fx.Node) and _close(a[1 - i], 1 / _RT2):
                return got
    return None


def _half(node: object, x: fx.Node) -> bool:
    return isinstance(node, fx.Node) and op_kind(node) == "mul" and _close(_other(node, x), 0.5)


@register
class GeluErf(Legalize):
    """0.5 * x * (1 + erf(x / sqrt(2))) -> gelu(x): the same function as one op.

    Exact in math; the op's kernel rounds its own way. ExecuTorch's XNNPACK partitioner
    has no erf (there is no ErfConfig), so the written-out form leaves erf on the portable
    kernels and splits the delegate at every MLP; XNNPACK's GeluConfig takes gelu. The
    half may be applied to x first (0.5 * x, then the product) or last."""

    name = "legalize.gelu_erf"
    relieves = ("delegation:activation",)
    anchors = ("erf",)
    description = (
        "GELU written out with erf -> one gelu op, which XNNPACK delegates (it has no erf)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        x = _scaled_input(node.args[0] if node.args else None)
        if x is None:
            return None  # an erf that is not GELU's
        scaled = node.args[0]
        assert isinstance(scaled, fx.Node)
        plus = _only_reader(node)
        if plus is None or op_kind(plus) != "add" or not _close(_other(plus, node), 1.0):
            return Refused(f"{node.name} is not followed by 1 + erf alone")
        prod = _only_reader(plus)
        if prod is None or op_kind(prod) != "mul":
            return Refused(f"1 + {node.name} is not multiplied by x alone")
        other = _other(prod, plus)
        if _half(other, x):
            assert isinstance(other, fx.Node)
            nodes = (scaled, node, plus, other, prod)
        elif other is x:
            last = _only_reader(prod)
            if last is None or not _half(last, prod):
                return Refused(f"{prod.name} is x * (1 + erf(...)) without the factor 0.5")
            nodes = (scaled, node, plus, prod, last)
        else:
            return Refused(f"{prod.name} multiplies 1 + erf by something other than x / 2")
        return Found(
            nodes,
            f"{nodes[-1].name}: GELU of {x.name} written out with erf -> gelu",
            dict(x=x),
            record=dict(x=x.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        replace_with(gm, found.nodes[-1], "gelu", (found["x"],), remove=found.nodes[::-1])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return Estimate(note="legalisation: erf's five ops become one the delegate takes")
