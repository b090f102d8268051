"""Reading a softmax off a graph for softmax.softmax and softmax.stable_softmax:
the op (aten softmax / _softmax / log_softmax, F.softmax, nn.Softmax), the scale and mask
that feed it, and the hand-written forms exp(x - max) / sum(exp(x - max)) (safe) and
exp(x) / sum(exp(x)) (unsafe)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from opswap.graph.ops import arg, module_of, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules._matching import setting


@dataclass
class Softmax:
    x: fx.Node  # the scores, before the folded scale and mask
    nodes: list[fx.Node]  # what the rewrite removes, the softmax (the output) last
    log: bool
    mask: fx.Node | None
    scale: float
    dtype: torch.dtype | None  # the output's, when it differs from x's
    hidden: int
    rows: int
    in_dtype: torch.dtype
    form: str  # "op" or "written out"


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _last_dim(dim: object, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1


def _shape_checks(x: fx.Node, what: str) -> tuple[int, int, torch.dtype] | str:
    xi = info(x)
    if xi is None or not xi.shape:
        return f"the shape of the input of {what} is unknown"
    if not xi.dtype.is_floating_point or xi.dtype == torch.float64:
        return f"{what} is over {xi.dtype}; the kernel takes bfloat16, float16 or float32"
    n = int(xi.shape[-1])
    return n, xi.numel // max(n, 1), xi.dtype


def _op_args(sm: fx.Node) -> tuple[object, torch.dtype | None] | str:
    """(dim, output dtype or None) of a softmax op node, or a reason."""
    if sm.op == "call_module":
        return getattr(module_of(sm), "dim", None), None
    name = raw_name(sm)
    if name == "_safe_softmax":
        return (
            f"{sm.name} is a _safe_softmax, which returns 0 on fully masked rows where the "
            "kernel (as torch.softmax) returns NaN"
        )
    if name in ("_softmax", "_log_softmax"):
        return setting(sm, "dim", None), (
            torch.float32 if setting(sm, "half_to_float", False) else None
        )
    dtype = setting(sm, "dtype", None)
    return setting(sm, "dim", None), dtype if isinstance(dtype, torch.dtype) else None


def _scale_of(z: fx.Node) -> tuple[fx.Node, float, list[fx.Node]]:
    """(x, scale, the mul/div node) for z = x * c, c * x or x / c read only once; else
    (z, 1.0, [])."""
    if len(z.users) == 1 and op_kind(z) in ("mul", "div") and len(z.args) == 2:
        a, b = z.args
        if op_kind(z) == "mul" and _number(a) is not None and isinstance(b, fx.Node):
            return b, float(a), [z]  # type: ignore[arg-type]
        c = _number(b)
        if c is not None and c != 0 and isinstance(a, fx.Node):
            return a, (c if op_kind(z) == "mul" else 1.0 / c), [z]
    return z, 1.0, []


def _folded(z: fx.Node) -> tuple[fx.Node, fx.Node | None, float, list[fx.Node]]:
    """(scores, mask, scale, the nodes folded in) for what feeds a softmax: scores * c +
    mask, scores + mask, scores * c, or the scores alone."""
    zi = info(z)
    if (
        zi is not None
        and op_kind(z) == "add"
        and len(z.users) == 1
        and len(z.args) == 2
        and all(isinstance(a, fx.Node) for a in z.args)
        and not z.kwargs.get("alpha")
    ):
        a, b = z.args
        assert isinstance(a, fx.Node) and isinstance(b, fx.Node)
        ai, bi = info(a), info(b)
        if ai is not None and bi is not None and ai.dtype == bi.dtype == zi.dtype:
            # the scores have the sum's shape: the scaled side, else the side whose other
            # broadcasts, else the first
            sides = [(a, b, bi), (b, a, ai)]
            full = [(s, m, mi) for s, m, mi in sides if (ai if s is a else bi).shape == zi.shape]
            full.sort(key=lambda p: (not _scale_of(p[0])[2], p[2].shape == zi.shape))
            if full and len(zi.shape) <= 4:
                s, m, _ = full[0]
                x, c, scaled = _scale_of(s)
                return x, m, c, [*scaled, z]
    x, c, scaled = _scale_of(z)
    return x, None, c, scaled


def read_op(gm: fx.GraphModule, sm: fx.Node) -> Softmax | str | None:
    """The softmax op at `sm`, with the scale and mask feeding it folded in."""
    got = _op_args(sm)
    if isinstance(got, str):
        return got
    dim, dtype = got
    z = sm.args[0] if sm.args else sm.kwargs.get("input")
    if not isinstance(z, fx.Node):
        return None
    zi = info(z)
    if zi is None:
        return f"the shape of the input of {sm.name} is unknown"
    if dim is None or not _last_dim(dim, len(zi.shape)):
        return f"{sm.name} is over dim {dim}, not its last dim; the kernel reduces the last"
    log = op_kind(sm) == "log_softmax"
    x, mask, scale, folded = _folded(z) if not log else (z, None, 1.0, [])
    checked = _shape_checks(x, sm.name)
    if isinstance(checked, str):
        return checked
    n, rows, in_dtype = checked
    if dtype == in_dtype:
        dtype = None
    return Softmax(x, [*folded, sm], log, mask, scale, dtype, n, rows, in_dtype, "op")


def _reduces_last(node: fx.Node, kinds: tuple[str, ...]) -> fx.Node | None:
    """The input of `node` when it is a keepdim reduction of `kinds` over the last dim."""
    if node.op not in ("call_function", "call_method") or op_kind(node) not in kinds:
        return None
    src = node.args[0] if node.args else None
    si = info(src) if isinstance(src, fx.Node) else None
    if si is None or not _last_dim(arg(node, 1, "dim"), len(si.shape)):
        return None
    return src if arg(node, 2, "keepdim", False) else None  # type: ignore[return-value]


def _row_max_of(m: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, nodes) for m = amax(x, -1, keepdim=True), x.max(-1, keepdim=True)[0] / .values."""
    nodes = [m]
    if raw_name(m) in ("getitem", "getattr") and isinstance(m.args[0], fx.Node):
        if m.args[1] not in (0, "values"):
            return None
        m = m.args[0]
        nodes.insert(0, m)
    if raw_name(m) not in ("amax", "max"):
        return None
    x = _reduces_last(m, ("amax",))
    return (x, nodes) if x is not None else None


def read_written(gm: fx.GraphModule, div: fx.Node) -> Softmax | str | None:
    """exp(x - max) / sum(exp(x - max), -1, keepdim) (form "written out"), or a reason
    naming the unsafe exp(x) / sum(exp(x)) (form "unsafe")."""
    if len(div.args) != 2 or not all(isinstance(a, fx.Node) for a in div.args):
        return None
    e, s = div.args
    assert isinstance(e, fx.Node) and isinstance(s, fx.Node)
    if op_kind(e) != "exp" or _reduces_last(s, ("sum",)) is not e:
        return None
    inner = e.args[0]
    if not isinstance(inner, fx.Node):
        return None
    nodes: list[fx.Node] = []
    if op_kind(inner) == "sub" and len(inner.args) == 2 and isinstance(inner.args[1], fx.Node):
        got = _row_max_of(inner.args[1])
        if got is None or got[0] is not inner.args[0]:
            return None
        x, form = got[0], "written out"
        nodes = [*got[1], inner]
    else:
        x, form = inner, "unsafe"
    checked = _shape_checks(x, div.name)
    if isinstance(checked, str):
        return checked
    n, rows, in_dtype = checked
    return Softmax(x, [*nodes, e, s, div], False, None, 1.0, None, n, rows, in_dtype, form)


def fused_bytes(sm: Softmax) -> int:
    """The kernel's traffic: read x (and the mask, once per its own elements), write y."""
    elt = torch.empty((), dtype=sm.in_dtype).element_size()
    out = torch.empty((), dtype=sm.dtype or sm.in_dtype).element_size()
    mi = info(sm.mask) if sm.mask is not None else None
    return sm.rows * sm.hidden * (elt + out) + (mi.nbytes if mi is not None else 0)


def install(gm: fx.GraphModule, sm: Softmax) -> None:
    """Replace the pattern by opswap::softmax, log_softmax or masked_softmax."""
    from opswap.rules._edits import replace_with

    ops = torch.ops.opswap
    args: tuple
    if sm.mask is not None or sm.scale != 1.0:
        op, args = ops.masked_softmax.default, (sm.x, sm.mask, sm.scale, sm.dtype)
    else:
        op, args = (ops.log_softmax if sm.log else ops.softmax).default, (sm.x, sm.dtype)
    replace_with(gm, sm.nodes[-1], op, args, remove=sm.nodes)
