"""fusion.matmul_add: x @ W + b with constant W and b -> one linear.

`x @ W + b` with constant W and b runs a GEMM that writes x @ W, then an add
that reads it back with b and writes the sum: one linear (GEMM with the bias in
its epilogue) never materialises x @ W.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import is_aten, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import new_const, replace_with
from opswap.rules._matching import const, describe_source, shared_reason
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

aten = torch.ops.aten

_MATMUL_NAMES = {"matmul", "__matmul__", "mm"}


def _bias_vector(
    b: torch.Tensor | float, n: int, out_ndim: int, dtype: torch.dtype
) -> torch.Tensor | str:
    """b as a length-n bias vector when adding it broadcasts along the last dim only."""
    if not isinstance(b, torch.Tensor):  # a number (the caller refuses a bool)
        return torch.full((n,), float(b), dtype=dtype)
    if b.dtype != dtype:
        return f"the bias is {b.dtype} but x @ W is {dtype}, so the add would change the type"
    if (
        b.dim() > out_ndim
        or any(s != 1 for s in b.shape[:-1])
        or (b.dim() and b.shape[-1] not in (1, n))
    ):
        return (
            f"the added constant has shape {list(b.shape)}, which is not a bias along the "
            f"last dim (expected [{n}])"
        )
    return b.reshape(-1).expand(n).clone() if b.dim() else b.reshape(1).expand(n).clone()


@register
class MatMulAdd(Rule):
    """x @ W + b, with W [K, N] and b constants -> linear(x, W.T, b).

    W is transposed once at rewrite time into Linear's [N, K] layout; the add
    moves into the GEMM's epilogue, so x @ W is never written out and re-read.
    """

    name = "fusion.matmul_add"
    training = True
    family = "fusion"
    chapter = 4
    exactness = "exact"
    relieves = ("memory:elementwise",)
    description = (
        "x @ W + b with constant W [K, N] and bias b -> linear(x, W^T, b): the bias "
        "is added in the GEMM epilogue, so x @ W is not written out and re-read."
    )

    anchors = ("add",)

    def check(self, gm: fx.GraphModule, add: fx.Node) -> Found | Refused | None:
        if len(add.args) != 2:
            return None
        pair = next(
            (
                (a, b)
                for a, b in (add.args, add.args[::-1])
                if isinstance(a, fx.Node)
                and op_kind(a) == "matmul"
                and raw_name(a) in _MATMUL_NAMES
            ),
            None,
        )
        if pair is None:
            return None
        mm, b = pair
        if not isinstance(b, (fx.Node, int, float)) or isinstance(b, bool):
            return None
        x, w_node = mm.args[0], mm.args[1]
        w = const(gm, w_node)
        b_t = b if not isinstance(b, fx.Node) else const(gm, b)
        if w is None and b_t is None:
            return None  # x @ y + z with nothing constant: not a near-match
        if w is None:
            return Refused(f"W of {mm.name} is not a constant: it is {describe_source(w_node)}")
        if b_t is None:
            return Refused(
                f"the bias added by {add.name} is not a constant: it is {describe_source(b)}"
            )
        if add.kwargs.get("alpha", 1) != 1:
            return Refused(
                f"{add.name} scales its operand (alpha), which a linear's bias cannot express"
            )
        if w.dim() != 2:
            return Refused(f"W of {mm.name} is {w.dim()}-D; a linear needs a 2-D weight")
        out = info(mm)
        if out is None:
            return Refused(f"the shape of {mm.name} is unknown")
        bias = _bias_vector(b_t, w.shape[1], len(out.shape), out.dtype)
        if isinstance(bias, str):
            return Refused(bias)
        shared = shared_reason(mm, {add}, "the add cannot move into its epilogue")
        if shared:
            return Refused(shared)
        return Found(
            (mm, add),
            f"{mm.name} + {add.name} -> linear",
            dict(mm=mm, x=x, w=w, bias=bias, b_node=b),
            record=dict(matmul=mm.name, add=add.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        mm, add = found.nodes
        x, w, bias, b_node = found["x"], found["w"], found["bias"], found["b_node"]
        w_node = mm.args[1]
        base = (
            str(w_node.target)
            if isinstance(w_node, fx.Node) and w_node.op == "get_attr"
            else f"{mm.name}_weight"
        )
        wt = new_const(gm, mm, f"{base}_t", w.detach().t().contiguous())
        b_given = const(gm, b_node) if isinstance(b_node, fx.Node) else None
        if (
            b_node is not None
            and isinstance(b_node, fx.Node)
            and b_node.op == "get_attr"
            and b_given is not None
            and tuple(b_given.shape) == tuple(bias.shape)
        ):
            b = b_node  # already a bias vector: keep it (and its name)
        else:
            b = new_const(gm, mm, f"{base}_bias", bias.detach().clone())
        fn = aten.linear.default if is_aten(mm) else F.linear
        replace_with(gm, add, fn, (x, wt, b), remove=[add, mm])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        add = found.nodes[-1]
        out = info(add)
        bias_bytes = out.nbytes // max(out.numel, 1) * out.shape[-1] if out and out.shape else 0
        # the add's arithmetic happens in the GEMM epilogue, which also reads the bias once
        epilogue = NodeCost(node_cost(add).flops, bias_bytes)
        return saving(
            target,
            [add],
            [epilogue],
            "bias added in the GEMM epilogue: x @ W is not written out and re-read",
        )
