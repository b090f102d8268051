"""Reading an RMSNorm off a graph, on what it computes, for norm.rms_norm and
norm.add_rms_norm.

Two shapes qualify. The written-out one, as HF's LlamaRMSNorm (and Qwen's, Mistral's,
Gemma's) is captured, read from its rsqrt outward:

    xf = x.to(float32)                       optional upcast
    h  = xf * rsqrt(mean(xf ** 2, -1, keepdim=True) + eps)     (xf * xf, square(xf) too)
    h  = h.to(x.dtype)                       optional: cast before the weight (Llama)
    y  = w * h   or   h * (1 + w)            optional; w a constant [N] (Gemma: 1 + w)
    y  = y.to(x.dtype)                       optional: cast after the weight (Gemma)

and the op itself: nn.RMSNorm, F.rms_norm, aten.rms_norm over the last dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.node import Argument

from opswap.graph.ops import arg, module_of, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules._matching import const, describe_source, setting


@dataclass
class RMS:
    x: fx.Node  # the normalised input, before any upcast
    nodes: list[fx.Node]  # every node of the pattern (x, constants excluded), output last
    out: fx.Node
    eps: float
    weight: fx.Node | torch.Tensor | None  # a get_attr node, or a module's parameter
    offset: float
    cast_first: bool
    hidden: int
    rows: int
    dtype: torch.dtype  # x's


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _other(node: fx.Node, one: Argument) -> Argument:
    a, b = node.args[:2]
    return b if a is one else a


def _is_cast(n: fx.Node) -> bool:
    return op_kind(n) == "to" or raw_name(n) == "type_as"


def _weight(gm: fx.GraphModule, v: Argument) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """(the weight's get_attr, offset, the nodes between) for `w`, `w.float()`, `1 + w`
    or `1 + w.float()`."""
    offset, between = 0.0, []
    if isinstance(v, fx.Node) and op_kind(v) == "add" and len(v.args) == 2:
        a, b = v.args
        num_a = _number(a) is not None
        if (_number(a) if num_a else _number(b)) != 1.0:
            return None
        between.append(v)
        v, offset = (b if num_a else a), 1.0
    if isinstance(v, fx.Node) and _is_cast(v) and v.args and len(v.users) == 1:
        between.append(v)
        v = v.args[0]
    if isinstance(v, fx.Node) and v.op == "get_attr" and const(gm, v) is not None:
        return v, offset, between
    return None


def not_a_cast(n: fx.Node) -> bool:
    """Whether `n` is a cast to the dtype its input already has (a no-op)."""
    src = n.args[0] if n.args else None
    if not _is_cast(n) or not isinstance(src, fx.Node):
        return False
    a, b = info(src), info(n)
    return a is not None and b is not None and a.dtype == b.dtype


def _last_dim(dims: int | Sequence[int] | None, ndim: int) -> bool:
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] % ndim == ndim - 1


def read_written(gm: fx.GraphModule, r: fx.Node) -> RMS | str | None:
    """The written-out RMSNorm around rsqrt node `r`, a reason it does not qualify, or None
    when it is not one."""
    ve = arg(r, 0, "input")
    if not isinstance(ve, fx.Node) or op_kind(ve) != "add" or len(ve.args) != 2:
        return None
    first = ve.args[0]
    mean_first = isinstance(first, fx.Node) and op_kind(first) == "mean"
    var, eps_v = (ve.args[0], ve.args[1]) if mean_first else (ve.args[1], ve.args[0])
    if not isinstance(var, fx.Node) or op_kind(var) != "mean":
        return None
    sq = arg(var, 0, "input")
    if not isinstance(sq, fx.Node):
        return None
    if op_kind(sq) == "pow" and (len(sq.args) == 1 or _number(sq.args[1]) == 2.0):
        xf = sq.args[0]
    elif op_kind(sq) == "mul" and len(sq.args) == 2 and sq.args[0] is sq.args[1]:
        xf = sq.args[0]
    else:
        return None
    if not isinstance(xf, fx.Node):
        return None
    h = next(
        (u for u in r.users if op_kind(u) == "mul" and set(u.args[:2]) == {xf, r}),
        None,
    )
    if h is None:
        return None
    eps = _number(eps_v)
    if eps is None:
        return f"eps is {describe_source(eps_v)}, not a constant: the kernel takes a number"
    upcast = op_kind(xf) == "to" and isinstance(xf.args[0], fx.Node)
    if upcast and not_a_cast(xf):
        upcast = False  # x.to(float32) of a float32 x: export reuses it elsewhere, leave it
    x = xf.args[0] if upcast else xf
    assert isinstance(x, fx.Node)
    xi = info(x)
    if xi is None or not xi.shape:
        return f"the shape of {x.name} is unknown"
    if not xi.dtype.is_floating_point or xi.dtype == torch.float64:
        return f"{x.name} is {xi.dtype}; the kernel takes bfloat16, float16 or float32"
    ndim = len(xi.shape)
    dims = arg(var, 1, "dim")
    if not _last_dim(dims, ndim) or not arg(var, 2, "keepdim", False):
        return (
            f"the mean reduces over dim(s) {dims} of a {ndim}-D tensor (keepdim "
            f"{bool(arg(var, 2, 'keepdim', False))}), not its last dim: the kernel normalises rows"
        )
    nodes = ([xf] if upcast else []) + [sq, var, ve, r, h]
    out, cast_first, weight, offset = h, False, None, 0.0
    nxt = _only_user(out)
    if nxt is not None and _is_cast(nxt):
        ci = info(nxt)
        if ci is not None and ci.dtype == xi.dtype:
            nodes.append(nxt)
            out, cast_first = nxt, True
            nxt = _only_user(out)
    if nxt is not None and op_kind(nxt) == "mul" and len(nxt.args) == 2:
        other = _other(nxt, out)
        found = _weight(gm, other)
        if found is not None:
            weight, offset, between = found
            nodes += [*between, nxt]
            out = nxt
            nxt = _only_user(out)
            wi = const(gm, weight)
            if wi is None or tuple(wi.shape) != (xi.shape[-1],):
                return f"the weight has shape {None if wi is None else list(wi.shape)}, not [{xi.shape[-1]}]"
    if not cast_first and nxt is not None and _is_cast(nxt):
        ci = info(nxt)
        if ci is not None and ci.dtype == xi.dtype:
            nodes.append(nxt)
            out = nxt
    nodes = [n for n in dict.fromkeys(nodes) if isinstance(n, fx.Node) and n.op != "get_attr"]
    return RMS(
        x,
        nodes,
        out,
        eps,
        weight,
        offset,
        cast_first,
        int(xi.shape[-1]),
        int(xi.numel // max(xi.shape[-1], 1)),
        xi.dtype,
    )


def read_op(gm: fx.GraphModule, node: fx.Node) -> RMS | str | None:
    """nn.RMSNorm / F.rms_norm / aten.rms_norm at `node`, a reason it does not qualify,
    or None."""
    if raw_name(node) == "_fused_rms_norm":
        return None  # returns (y, rstd): a training graph's, not ours to take
    mod = module_of(node)
    x = arg(node, 0, "input")
    if not isinstance(x, fx.Node):
        return None
    if mod is not None:
        shape = tuple(getattr(mod, "normalized_shape", ()))
        w: fx.Node | torch.Tensor | None = getattr(mod, "weight", None)
        eps = setting(node, "eps", None)
    else:
        shape = tuple(arg(node, 1, "normalized_shape", ()) or ())
        w = arg(node, 2, "weight")
        eps = setting(node, "eps", None)
        if w is not None and not (isinstance(w, fx.Node) and w.op == "get_attr"):
            return f"the weight is {describe_source(w)}, not a constant"
    xi = info(x)
    if xi is None or not xi.shape:
        return f"the shape of {x.name} is unknown"
    if not xi.dtype.is_floating_point or xi.dtype == torch.float64:
        return f"{x.name} is {xi.dtype}; the kernel takes bfloat16, float16 or float32"
    if len(shape) != 1:
        return (
            f"it normalises over the last {len(shape)} dims {list(shape)}; the kernel "
            "normalises the last one"
        )
    if isinstance(eps, fx.Node):
        return f"eps is {describe_source(eps)}, not a constant: the kernel takes a number"
    eps_f = float(eps) if eps is not None else float(torch.finfo(xi.dtype).eps)
    return RMS(
        x,
        [node],
        node,
        eps_f,
        w,
        0.0,
        False,
        int(xi.shape[-1]),
        int(xi.numel // max(xi.shape[-1], 1)),
        xi.dtype,
    )


def read(gm: fx.GraphModule, node: fx.Node) -> RMS | str | None:
    """The RMSNorm anchored at `node` (an rsqrt or an rms_norm op)."""
    kind = op_kind(node)
    if kind == "rsqrt":
        return read_written(gm, node)
    if kind == "rms_norm":
        return read_op(gm, node)
    return None


def weight_arg(gm: fx.GraphModule, rms: RMS, before: fx.Node) -> fx.Node | None:
    """A node for the weight to pass to the op: its get_attr, or one made for a module's
    parameter."""
    w = rms.weight
    if w is None or isinstance(w, fx.Node):
        return w
    mod = module_of(rms.out)
    names = [name for name, p in mod.named_parameters() if p is w] if mod is not None else []
    target = f"{rms.out.target}.{names[0]}" if names else None
    if target is None:
        return None
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(target)


def fused_bytes(rms: RMS, residual: bool) -> int:
    """What the kernel reads and writes: x (and the residual) in, y (and the sum) out."""
    elt = torch.empty((), dtype=rms.dtype).element_size()
    oi = info(rms.out)
    out_elt = oi.nbytes // max(oi.numel, 1) if oi is not None else elt
    n = rms.rows * rms.hidden
    return n * (elt + out_elt) + (2 * n * elt if residual else 0) + 4 * rms.hidden
