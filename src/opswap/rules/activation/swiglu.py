"""activation.swiglu: `silu(g) * u` -> `opswap::glu` (two tensors), or, when g
and u are the two halves of one tensor (`x.chunk(2, -1)`, a merged gate_up Linear's
output), `opswap::glu_packed` on that tensor: one Triton kernel either way."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.ops import arg, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules import _triton
from opswap.rules._edits import replace_with
from opswap.rules._matching import setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.pattern import op, var
from opswap.rules.registry import register
from opswap.targets.base import Target


def _halves_of(g: fx.Node, u: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(x, the split node) when g = x.chunk(2, -1)[0] and u = x.chunk(2, -1)[1] (or split
    into two equal halves along the last dim), each getitem read only by the pattern."""
    if not all(n.op == "call_function" and n.target is operator.getitem for n in (g, u)):
        return None
    sp = g.args[0]
    if not isinstance(sp, fx.Node) or u.args[0] is not sp or (g.args[1], u.args[1]) != (0, 1):
        return None
    if op_kind(sp) != "split" or len(sp.users) != 2:
        return None
    x = sp.args[0]
    xi = info(x) if isinstance(x, fx.Node) else None
    if xi is None or not xi.shape or xi.shape[-1] % 2:
        return None
    ndim, last = len(xi.shape), xi.shape[-1]
    dim = setting(sp, "dim", 0)
    if not isinstance(dim, int) or dim % ndim != ndim - 1:
        return None
    size = arg(sp, 1, "chunks" if raw_name(sp) == "chunk" else "split_size_or_sections")
    if raw_name(sp) == "chunk" and size != 2:
        return None
    if raw_name(sp) != "chunk" and size not in (last // 2, [last // 2, last // 2]):
        return None
    assert isinstance(x, fx.Node)
    return x, sp


@register
class SwiGLUTriton(_triton.TritonRule):
    """silu(g) * u in one kernel with fp32 math inside. Exact: eager rounds silu(g) to the
    input dtype before the product and the kernel does not, one rounding fewer."""

    name = "activation.swiglu"
    family = "activation"
    chapter = 9
    relieves = ("memory:activation", "memory:elementwise")
    pattern = op("mul", op("silu", var("g")), var("u"))
    description = (
        "silu(gate) * up (SwiGLU), also on the two halves of one Linear's output -> "
        "opswap::glu / glu_packed: one Triton kernel reads gate and up once (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        m = self.pattern.match(gm, node)
        if m is None:
            return None
        g, u = m["g"], m["u"]
        gi, ui = info(g), info(u)
        if gi is None or ui is None:
            return Refused("the shapes of the gate and the up projection are unknown")
        if gi.shape != ui.shape or gi.dtype != ui.dtype:
            return Refused(
                f"silu({g.name}) * {u.name} broadcasts or promotes ({list(gi.shape)} "
                f"{gi.dtype} * {list(ui.shape)} {ui.dtype}); the kernel takes two tensors "
                "of one shape and dtype"
            )
        if not gi.dtype.is_floating_point or gi.dtype == torch.float64:
            return Refused(f"{g.name} is {gi.dtype}; the kernel takes bfloat16, float16 or float32")
        packed = _halves_of(g, u)
        nodes = list(m.nodes) if packed is None else [packed[1], g, u, *m.nodes]
        rows = gi.numel // max(gi.shape[-1], 1) if gi.shape else 1
        what = f"the halves of {packed[0].name}" if packed else f"{g.name} and {u.name}"
        return Found(
            nodes,
            f"{node.name} = silu(gate) * up on {what} -> opswap::glu"
            + ("_packed" if packed else ""),
            dict(g=g, u=u, x=packed[0] if packed else None),
            record=dict(out=node.name, packed=packed is not None),
            hidden=int(gi.shape[-1]) if gi.shape else 1,
            rows=int(rows),
            dtype=gi.dtype,
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        args: tuple
        if found["x"] is not None:
            op, args = torch.ops.opswap.glu_packed.default, (found["x"], "silu")
        else:
            op, args = torch.ops.opswap.glu.default, (found["g"], found["u"], "silu")
        replace_with(gm, found.nodes[-1], op, args, remove=found.nodes)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        h, m, dtype = found["hidden"], found["rows"], found["dtype"]
        elt = torch.empty((), dtype=dtype).element_size()
        fused = NodeCost(5 * m * h, 3 * m * h * elt)
        removed = [n for n in found.nodes if op_kind(n) in ("silu", "mul")]
        return _triton.predict(
            target, "swiglu", removed, fused, dtype, h, m, f"silu and mul -> 1 at {m} x {h}"
        )
