"""fusion.layer_norm: the hand-written LayerNorm, recognised and replaced by one op.

    mean = x.mean(-1, keepdim=True)
    var  = x.var(-1, keepdim=True, unbiased=False)    # or ((x - mean) ** 2).mean(...)
    y    = (x - mean) / torch.sqrt(var + eps)          # or (x - mean) * torch.rsqrt(...)
    y    = y * weight + bias                           # optional

Written out, this is 6 to 10 kernels, most reading and writing a tensor the size
of x (the mean and var are small); nn.LayerNorm reads x once and writes y once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import Argument

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, op_kind
from opswap.graph.shapes import TensorInfo, dynamic_dims, info
from opswap.rules._cost import saving
from opswap.rules._edits import swap_in_module
from opswap.rules._matching import const, describe_source
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target


class _NotLN(Exception):
    """The nodes do not have the LayerNorm structure at all (no near-match)."""


@dataclass
class _LayerNorm:
    x: fx.Node
    nodes: list[fx.Node]  # every node of the pattern, x and constants excluded
    out: fx.Node
    dims: tuple[int, ...]  # reduced dims as written
    eps: float
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    home: fx.Node | None = None  # the weight's get_attr, to name the new module after
    misses: list[tuple[fx.Node, str]] = field(default_factory=list)


def _reduce(node: fx.Node) -> tuple[fx.Node, tuple[int, ...], bool]:
    """(input, dims, keepdim) of a mean / var over explicit dims."""
    x, dims = arg(node, 0, "input"), arg(node, 1, "dim")
    if not isinstance(x, fx.Node) or dims is None or isinstance(dims, fx.Node):
        raise _NotLN
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    keep_at = 3 if op_kind(node) == "var" and len(node.args) > 2 else 2
    return x, dims, bool(arg(node, keep_at, "keepdim", False))


def _population(var: fx.Node) -> bool:
    """True when a var node divides by N (unbiased=False or correction=0)."""
    if len(var.args) > 2 and isinstance(var.args[2], bool):
        return not var.args[2]
    if "unbiased" in var.kwargs:
        return not var.kwargs["unbiased"]
    return bool(var.kwargs.get("correction", 1) == 0)


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _split_const(node: fx.Node) -> tuple[object, object]:
    """(tensor operand, other operand) of a binary op whose other operand is 'the
    second thing' (a number or a node)."""
    a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    return (a, b) if isinstance(a, fx.Node) else (b, a)


def _root(node: fx.Node, kind: str, power: float) -> fx.Node:
    """The argument of sqrt(v) / rsqrt(v), also spelled v ** 0.5 / v ** -0.5."""
    if op_kind(node) == kind:
        return arg(node, 0, "input")
    if op_kind(node) == "pow" and _number(node.args[1]) == power:
        # with a number for exponent, the traced base is a node
        return cast(fx.Node, node.args[0])
    raise _NotLN


def _is_root(node: Argument, kind: str, power: float) -> bool:
    try:
        return isinstance(node, fx.Node) and _root(node, kind, power) is not None
    except _NotLN:
        return False


def _mean_of(node: Argument, dims: tuple[int, ...]) -> fx.Node:
    if not isinstance(node, fx.Node) or op_kind(node) != "mean":
        raise _NotLN
    x, d, keep = _reduce(node)
    if d != dims or not keep:
        raise _NotLN
    return x


def _centered(node: Argument, x: fx.Node, dims: tuple[int, ...]) -> fx.Node:
    """Check `node` is x - mean(x, dims); returns it."""
    if not isinstance(node, fx.Node) or op_kind(node) != "sub" or len(node.args) != 2:
        raise _NotLN
    a, m = node.args
    if a is not x or _mean_of(m, dims) is not x:
        raise _NotLN
    return node


def _variance(v: fx.Node, x: fx.Node, dims: tuple[int, ...], nodes: list[fx.Node]) -> None:
    """Check `v` is the population variance of x over dims; collects its nodes."""
    if op_kind(v) == "var":
        vx, vdims, keep = _reduce(v)
        if vx is not x or vdims != dims or not keep:
            raise _NotLN
        nodes.append(v)
        return
    sq = arg(v, 0, "input")
    _mean_of(v, dims)
    if not isinstance(sq, fx.Node):
        raise _NotLN
    if op_kind(sq) == "pow" and len(sq.args) == 1:  # torch.square
        e = sq.args[0]
    elif op_kind(sq) == "pow" and _number(sq.args[1]) == 2.0:
        e = sq.args[0]
    elif op_kind(sq) == "mul" and len(sq.args) == 2 and sq.args[0] is sq.args[1]:
        e = sq.args[0]
    else:
        raise _NotLN
    c = _centered(e, x, dims)
    nodes += [v, sq, c, cast(fx.Node, c.args[1])]  # _centered checked it is the mean


def _normalised(n: fx.Node) -> _LayerNorm:
    """Read the pattern whose normalised output is `n`; raises _NotLN if it is not one."""
    if op_kind(n) == "div" and len(n.args) == 2 and not n.kwargs:
        d, s = n.args
        ve = _root(s, "sqrt", 0.5) if isinstance(s, fx.Node) else None
    elif op_kind(n) == "mul" and len(n.args) == 2:
        pairs = [(a, b) for a, b in (n.args, n.args[::-1]) if _is_root(b, "rsqrt", -0.5)]
        if not pairs:
            raise _NotLN
        d, s = pairs[0]
        ve = _root(cast(fx.Node, s), "rsqrt", -0.5)  # _is_root checked it is a node
    else:
        raise _NotLN
    if ve is None or not isinstance(d, fx.Node) or op_kind(d) != "sub":
        raise _NotLN
    x = d.args[0]
    if not isinstance(x, fx.Node) or not isinstance(d.args[1], fx.Node):
        raise _NotLN
    dims = _reduce(d.args[1])[1]
    _centered(d, x, dims)
    eps = 0.0
    if op_kind(ve) == "add":
        v, e = _split_const(ve)
        number = _number(e)
        if number is None or not isinstance(v, fx.Node):
            raise _NotLN
        eps, extra = number, [ve]
    else:
        v, extra = ve, []
    # s is a node: only a node has a root read off it above
    nodes = [n, cast(fx.Node, s), *extra, d, cast(fx.Node, d.args[1])]
    _variance(v, x, dims, nodes)
    return _LayerNorm(x, list(dict.fromkeys(nodes)), n, dims, eps)


def _affine_const(
    gm: fx.GraphModule, value: Argument, norm_shape: Sequence[int], x_dtype: torch.dtype
) -> torch.Tensor | None:
    """`value` as a LayerNorm weight/bias of shape norm_shape, or None if it is not
    one (not a constant, other dtype, varies along a non-normalised dim)."""
    t = const(gm, value)
    if t is None or t.dtype != x_dtype:
        return None
    k = len(norm_shape)
    lead, tail = t.shape[:-k] if t.dim() > k else (), t.shape[-k:]
    if any(s != 1 for s in lead):
        return None
    try:
        return t.reshape(tail).expand(norm_shape).clone()
    except RuntimeError:
        return None


def _absorb_affine(
    gm: fx.GraphModule, ln: _LayerNorm, norm_shape: Sequence[int], dtype: torch.dtype
) -> None:
    """Extend the pattern over `* weight` and `+ bias` when they are constants."""
    cur = ln.out
    for kind in ("mul", "add"):
        if len(cur.users) != 1:
            return
        (u,) = cur.users
        if op_kind(u) != kind or len(u.args) != 2 or u.kwargs:
            return
        other = u.args[1] if u.args[0] is cur else u.args[0]
        t = _affine_const(gm, other, norm_shape, dtype)
        if t is None:
            if kind == "mul" and isinstance(other, fx.Node) and const(gm, other) is None:
                ln.misses.append(
                    (
                        u,
                        f"the multiply by {other.name} is not folded into the "
                        f"LayerNorm: it is {describe_source(other)}, not a "
                        "constant weight",
                    )
                )
            if kind == "mul":
                continue  # no weight, maybe a bias: `norm + b`
            return
        if kind == "mul":
            ln.weight, ln.home = t, other if isinstance(other, fx.Node) else None
        else:
            ln.bias = t
            ln.home = ln.home or (other if isinstance(other, fx.Node) else None)
        ln.nodes.append(u)
        ln.out = cur = u


@register
class LayerNormFusion(Rule):
    """The hand-written LayerNorm -> nn.LayerNorm (one kernel, one read, one write).

    Only the population variance (divide by N) qualifies: with `unbiased=True` the
    function is not LayerNorm, and replacing it would change the numbers by a
    factor sqrt(N / (N - 1)). The reduction must cover the last dim(s), which is
    what LayerNorm's normalized_shape means. A constant `* weight` and `+ bias`
    after the normalisation become the module's parameters; a multiply by a
    non-constant stays a separate op (reported as a miss).
    """

    name = "fusion.layer_norm"
    training = True
    family = "fusion"
    chapter = 4
    exactness = "exact"
    relieves = ("memory:elementwise", "memory:normalization")
    description = (
        "Hand-written LayerNorm (mean, variance, sub, div by sqrt(var + eps) or mul "
        "by rsqrt, optional * weight + bias) -> nn.LayerNorm: one kernel reading x "
        "once instead of 6-10 kernels, most reading and writing a tensor of x's size."
    )

    anchors = ("div", "mul")

    def _find(self, gm: fx.GraphModule, n: fx.Node) -> _LayerNorm | str | None:
        try:
            ln = _normalised(n)
        except _NotLN:
            return None
        x_info = info(ln.x)
        if x_info is None:
            return f"the shape of {ln.x.name} is unknown"
        ndim = len(x_info.shape)
        dims = sorted(d % ndim for d in ln.dims) if ndim else []
        if dims != list(range(ndim - len(dims), ndim)) or not dims:
            return (
                f"the mean reduces over dim(s) {list(ln.dims)} of a {ndim}-D tensor, not its "
                "last dim(s): this is not a LayerNorm"
            )
        var = next((v for v in ln.nodes if op_kind(v) == "var"), None)
        if var is not None and not _population(var):
            return (
                f"{var.name} is the unbiased variance (divides by N-1); LayerNorm divides by "
                "N, so the result would change"
            )
        if not x_info.dtype.is_floating_point:
            return f"{ln.x.name} is {x_info.dtype}, not a floating-point tensor"
        moving = sorted(dynamic_dims(ln.x) & set(dims))
        if moving:
            return (
                f"it normalises over dim {moving[0]} of {ln.x.name}, whose size follows the "
                "input (a batch or sequence size); nn.LayerNorm fixes normalized_shape"
            )
        norm_shape = x_info.shape[ndim - len(dims) :]
        _absorb_affine(gm, ln, norm_shape, x_info.dtype)
        inside = set(ln.nodes)
        for node in ln.nodes:
            if node is ln.out:
                continue
            escaped = [u for u in node.users if u not in inside]
            if escaped:
                return (
                    f"{node.name} (part of the LayerNorm) is also read by {escaped[0].name}, "
                    "so the pattern cannot become one op"
                )
        return ln

    def check(self, gm: fx.GraphModule, node: fx.Node) -> list[Found | Refused] | None:
        ln = self._find(gm, node)
        if ln is None:
            return None
        if isinstance(ln, str):
            return [Refused(ln)]
        first = min(ln.nodes, key=lambda n: list(gm.graph.nodes).index(n))
        affine = (
            "with weight and bias"
            if ln.weight is not None and ln.bias is not None
            else "with weight"
            if ln.weight is not None
            else "with bias"
            if ln.bias is not None
            else "without affine"
        )
        found = Found(
            ln.nodes,
            f"replace the written-out LayerNorm of {ln.x.name} "
            f"({len(ln.nodes)} ops, eps={ln.eps:g}, {affine}) by nn.LayerNorm",
            dict(ln=ln),
            key=f"{first.name}..{ln.out.name}",
            outputs=(ln.out,),
            record=dict(x=ln.x.name, out=ln.out.name, norm=node.name, eps=ln.eps),
        )
        return [*(Refused(why, where) for where, why in ln.misses), found]

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        ln = found["ln"]
        x_info = cast(TensorInfo, info(ln.x))  # check read the shape of x
        norm_shape = x_info.shape[len(x_info.shape) - len(ln.dims) :]
        affine = ln.weight is not None or ln.bias is not None
        mod = nn.LayerNorm(
            norm_shape,
            eps=ln.eps,
            elementwise_affine=affine,
            bias=ln.bias is not None,
            dtype=x_info.dtype,
        )
        ref = ln.weight if ln.weight is not None else ln.bias
        if ref is not None:
            mod.to(ref.device)
            with torch.no_grad():
                mod.weight.copy_(ln.weight if ln.weight is not None else torch.ones_like(ref))
                if ln.bias is not None:
                    mod.bias.copy_(ln.bias)
        swap_in_module(gm, mod, (ln.x,), ln.out, ln.nodes, "layer_norm", ln.home)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        ln = found["ln"]
        x_info, out_info = info(ln.x), info(ln.out)
        if x_info is None or out_info is None:
            return Estimate(note="shapes unknown")
        norm_numel = 1
        for s in x_info.shape[len(x_info.shape) - len(ln.dims) :]:
            norm_numel *= s
        n_params = (ln.weight is not None) + (ln.bias is not None)
        params = n_params * norm_numel * (x_info.nbytes // max(x_info.numel, 1))
        # the same arithmetic in one kernel that reads x (and the parameters) and writes y
        fused = NodeCost(
            sum(node_cost(n).flops for n in ln.nodes), x_info.nbytes + out_info.nbytes + params
        )
        return saving(
            target,
            ln.nodes,
            [fused],
            f"{len(ln.nodes)} kernels -> 1: the "
            "intermediates of x's size are no longer written and re-read",
        )
