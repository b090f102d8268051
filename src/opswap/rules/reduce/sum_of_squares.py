"""reduce.sum_of_squares: x.pow(2).sum(-1), (x * x).sum(-1), x.square().mean(-1)
and the like over the last dim -> `opswap::row_reduce(x, "sumsq" | "meansq")`: one
Triton kernel that squares as it reads, so x*x is never written nor read back."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.graph.ops import copy_meta, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules import _triton
from opswap.rules._edits import erase
from opswap.rules._matching import setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.registry import register
from opswap.targets.base import Target


def _square_of(sq: fx.Node) -> fx.Node | None:
    """x for sq = x ** 2, x * x or x.square(); else None."""
    if sq.op not in ("call_function", "call_method") or not sq.args:
        return None
    x = sq.args[0]
    if not isinstance(x, fx.Node):
        return None
    if raw_name(sq) == "square" and len(sq.args) == 1:
        return x
    if op_kind(sq) == "pow" and len(sq.args) == 2 and sq.args[1] in (2, 2.0):
        return x
    if op_kind(sq) == "mul" and len(sq.args) == 2 and sq.args[1] is x:
        return x
    return None


def _last_dim(dim: object, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1


@register
class SumOfSquaresTriton(_triton.TritonRule):
    """sum (or mean) of x*x over the last dim in one pass. Exact: the kernel squares in
    fp32 and accumulates in fp32, where eager rounds x*x to x's dtype first and then
    accumulates in fp32: one rounding fewer, and the row's sum in another order."""

    name = "reduce.sum_of_squares"
    family = "reduce"
    chapter = 15
    after = ("fusion.*", "norm.*")  # an RMSNorm's mean of squares is the norm rule's first
    relieves = ("memory:reduction", "memory:elementwise")
    anchors = ("sum", "mean")
    description = (
        "x.pow(2).sum(-1), (x * x).sum(-1), x.square().mean(-1) over the last dim -> "
        "opswap::row_reduce: one Triton kernel squares while it reads, x*x is never "
        "written (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        sq = node.args[0] if node.args else None
        if not isinstance(sq, fx.Node):
            return None
        x = _square_of(sq)
        if x is None:
            return None
        xi = info(x)
        if xi is None or not xi.shape:
            return Refused(f"the shape of {x.name} is unknown")
        dim = setting(node, "dim", None)
        if not _last_dim(dim, len(xi.shape)):
            return Refused(
                f"{node.name} reduces over dim {dim}, not the last one; the kernel reduces rows"
            )
        if setting(node, "dtype", None) is not None:
            return Refused(f"{node.name} accumulates into another dtype (dtype=...)")
        if not xi.dtype.is_floating_point or xi.dtype == torch.float64:
            return Refused(f"{x.name} is {xi.dtype}; the kernel takes bfloat16, float16 or float32")
        n = int(xi.shape[-1])
        rows = xi.numel // max(n, 1)
        mean = op_kind(node) == "mean"
        return Found(
            [sq, node],
            f"{'mean' if mean else 'sum'} of {x.name} squared over {n} -> "
            "opswap::row_reduce in one pass",
            dict(
                x=x, op="meansq" if mean else "sumsq", keepdim=bool(setting(node, "keepdim", False))
            ),
            record=dict(x=x.name, out=node.name, mean=mean),
            hidden=n,
            rows=rows,
            dtype=xi.dtype,
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        out = found.nodes[-1]
        with gm.graph.inserting_before(out):
            new = gm.graph.call_function(
                torch.ops.opswap.row_reduce.default,
                (found["x"], found["op"], True, found["keepdim"]),
            )
        copy_meta(new, out)
        out.replace_all_uses_with(new)
        erase(gm, found.nodes)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        n, m, dtype = found["hidden"], found["rows"], found["dtype"]
        elt = torch.empty((), dtype=dtype).element_size()
        fused = NodeCost(2 * m * n, m * n * elt + m * elt)
        return _triton.predict(
            target,
            "row_sumsq",
            found.nodes,
            fused,
            dtype,
            n,
            m,
            f"square and sum -> 1 at {m} x {n}",
        )
