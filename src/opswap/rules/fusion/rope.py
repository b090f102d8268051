"""fusion.rope: Hugging Face's apply_rotary_pos_emb after capture, q * cos +
rotate_half(q) * sin with rotate_half as slice / neg / cat, on q and on k with the same
cos and sin -> `opswap::rope`: one Triton kernel rotates both in one launch.

(In fusion/ for now: the attention family belongs to another part of the work; the rule
may move to attention/ later. A rotation with no partner takes the op on its own, with
an empty k.)"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.node import Argument

from opswap.cost import NodeCost
from opswap.graph.ops import arg, copy_meta, op_kind, raw_name
from opswap.graph.shapes import TensorInfo, info
from opswap.rules import _triton
from opswap.rules._edits import erase
from opswap.rules._matching import setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.registry import register
from opswap.targets.base import Target

_END = 2**62


def _slice(n: Argument, ndim: int) -> tuple[fx.Node, int, int] | None:
    """(x, start, end) for an aten.slice of x along its last dim."""
    if not isinstance(n, fx.Node) or raw_name(n) != "slice" or len(n.args) < 2:
        return None
    x, dim = n.args[0], n.args[1]
    start, end = arg(n, 2, "start", 0), arg(n, 3, "end", _END)
    ok = isinstance(dim, int) and dim % ndim == ndim - 1
    if not ok or not isinstance(start, int) or not isinstance(end, int):
        return None
    return x, start or 0, end  # type: ignore[return-value]


def _rotate_half(cat: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, nodes) for cat([-x[..., h:], x[..., :h]], -1) with h = D / 2."""
    if op_kind(cat) != "cat" or raw_name(cat) != "cat" or not cat.args:
        return None
    parts = cat.args[0]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    neg, first = parts
    ci = info(cat)
    if ci is None or not isinstance(neg, fx.Node) or op_kind(neg) != "neg":
        return None
    ndim, d = len(ci.shape), int(ci.shape[-1])
    if not _last_dim(setting(cat, "dim", 0), ndim):
        return None
    hi, lo = _slice(neg.args[0], ndim), _slice(first, ndim)
    if hi is None or lo is None or hi[0] is not lo[0] or d % 2:
        return None
    if lo[1:] != (0, d // 2) or hi[1] != d // 2 or hi[2] < d:
        return None
    return hi[0], [first, neg.args[0], neg, cat]  # type: ignore[list-item]


def _last_dim(dim: object, ndim: int) -> bool:
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1


def _other(mul: fx.Node, one: Argument) -> fx.Node | None:
    a, b = mul.args[:2]
    o = b if a is one else a if b is one else None
    return o if isinstance(o, fx.Node) else None


def read(add: fx.Node) -> dict | None:
    """{x, cos, sin, nodes} for add = x * cos + rotate_half(x) * sin, or None."""
    if op_kind(add) != "add" or len(add.args) != 2 or add.kwargs.get("alpha"):
        return None
    for a, b in (add.args, add.args[::-1]):
        if not all(isinstance(v, fx.Node) and op_kind(v) == "mul" for v in (a, b)):
            continue
        for cat in b.args[:2]:  # type: ignore[union-attr]
            if not isinstance(cat, fx.Node):
                continue
            rot = _rotate_half(cat)
            if rot is None:
                continue
            x, nodes = rot
            sin, cos = _other(b, cat), _other(a, x)  # type: ignore[arg-type]
            if sin is None or cos is None:
                continue
            return dict(x=x, cos=cos, sin=sin, nodes=[a, *nodes, b, add])
    return None


def _partners(add: fx.Node, r: dict) -> list[fx.Node]:
    """Other rotations by the same cos and sin, in graph order."""
    seen = []
    for mul in r["cos"].users:
        for cand in mul.users:
            if cand is not add and cand not in seen:
                got = read(cand)
                if got is not None and got["cos"] is r["cos"] and got["sin"] is r["sin"]:
                    seen.append(cand)
    order = {n: i for i, n in enumerate(add.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _table_ok(c: fx.Node, xi: TensorInfo) -> str | None:
    ci = info(c)
    if ci is None:
        return f"the shape of {c.name} is unknown"
    b, _, s, d = xi.shape
    shape = tuple(ci.shape)
    if shape in ((s, d), (1, s, d), (b, s, d), (1, 1, s, d), (b, 1, s, d)):
        return None
    return f"{c.name} {list(shape)} is not a [S, D] or [B, 1, S, D] table for {list(xi.shape)}"


@register
class RopeTriton(_triton.TritonRule):
    """RoPE on q and k in one kernel with fp32 math. Exact: the same products and sum,
    computed in fp32 and rounded once, where eager rounds each product and the sum to
    the tensors' dtype (fewer roundings)."""

    name = "fusion.rope"
    family = "fusion"
    chapter = 4
    after = ("fusion.matmul_add", "fusion.parallel_linear")
    relieves = ("memory:elementwise", "memory:data-movement")
    anchors = ("add",)
    description = (
        "HF's apply_rotary_pos_emb (q * cos + rotate_half(q) * sin, and the same for k) -> "
        "opswap::rope: q and k rotated by one Triton kernel in one launch (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        r = read(node)
        if r is None:
            return None
        partners = _partners(node, r)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if partners and order[partners[0]] < order[node]:
            return None  # the first rotation of the pair carries the site
        k = read(partners[0]) if partners else None
        xi = info(r["x"])
        if xi is None or len(xi.shape) != 4:
            return Refused(f"{r['x'].name} is not [B, H, S, D]; the kernel takes 4-D q and k")
        for c in (r["cos"], r["sin"]):
            why = _table_ok(c, xi)
            if why:
                return Refused(why)
        if not xi.dtype.is_floating_point or xi.dtype == torch.float64:
            return Refused(f"{r['x'].name} is {xi.dtype}; the kernel takes bf16, fp16 or fp32")
        ki = info(k["x"]) if k is not None else None
        if k is not None and (ki is None or ki.dtype != xi.dtype or ki.shape[::2] != xi.shape[::2]):
            k = None  # a partner of another shape or dtype: each on its own
        if k is not None and any(order[u] < order[k["nodes"][-1]] for u in node.users):
            k = None  # q's rotation is read before k's is computed: each on its own
        nodes = [*r["nodes"], *(k["nodes"] if k else [])]
        outs = (node, k["nodes"][-1]) if k else (node,)
        rows = xi.numel // int(xi.shape[-1]) + (ki.numel // int(ki.shape[-1]) if k and ki else 0)
        return Found(
            nodes,
            f"rotary embedding of {r['x'].name}"
            + (f" and {k['x'].name}" if k else "")
            + " -> opswap::rope (one launch)",
            dict(q=r, k=k),
            key="+".join(o.name for o in outs),
            outputs=outs,
            record=dict(q=r["x"].name, k=k["x"].name if k else None),
            hidden=int(xi.shape[-1]),
            rows=int(rows),
            dtype=xi.dtype,
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        q, k = found["q"], found["k"]
        g = gm.graph
        with g.inserting_before((k or q)["nodes"][-1]):  # every input exists by then
            kx = k["x"] if k else g.call_function(torch.ops.aten.slice.Tensor, (q["x"], 1, 0, 0))
            new = g.call_function(
                torch.ops.opswap.rope.default, (q["x"], kx, q["cos"], q["sin"], None, False)
            )
            outs = [g.call_function(operator.getitem, (new, i)) for i in range(2)]
        for out, r in zip(outs, (q, k), strict=True):
            if r is None:
                continue
            copy_meta(out, r["nodes"][-1])
            r["nodes"][-1].replace_all_uses_with(out)
        erase(gm, found.nodes)
        erase(gm, [o for o in outs if not o.users])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        d, m, dtype = found["hidden"], found["rows"], found["dtype"]
        elt = torch.empty((), dtype=dtype).element_size()
        fused = NodeCost(4 * m * d, 2 * m * d * elt)
        return _triton.predict(
            target, "rope", found.nodes, fused, dtype, d, m, f"{len(found.nodes)} ops -> 1"
        )
