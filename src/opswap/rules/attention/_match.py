"""Reading hand-written attention off a graph, on what it computes, for attention.sdpa.

From a softmax over the last dim, outward:

    scores = q @ kᵀ                  matmul / bmm; kᵀ a transpose or permute of k, or k
                                     stored transposed; q or k may be scaled first
    scores = scores * c  (or / c)    c a number, sqrt(d) of a static size, a 0-d constant
    scores = scores + mask           float masks and biases (T5's position bias), any number
    scores = where(keep, scores, v)  boolean masks (masked_fill too), v -inf or <= -1e30
    p = softmax(scores, -1)          with or without casts to float32 and back
    p = dropout(p)                   eval mode or p = 0 only
    out = p @ v

with grouped-query heads repeated by expand + reshape (HF's repeat_kv) or
repeat_interleave seen through, so SDPA can take the kv heads with enable_gqa.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.node import Argument

from opswap.graph.ops import arg, is_aten, module_of, op_kind, raw_name
from opswap.graph.shapes import info, shapes_seen
from opswap.rules._matching import describe_source, perm_of
from opswap.rules.attention._gqa import repeated
from opswap.rules.attention._static import Term, number

_MATMULS = ("matmul", "bmm", "__matmul__")
_PASS = ("to", "identity", "contiguous")  # no-op between the ops, casts included
#: a finite fill at or below this absorbs any score it is added to (float32 and bfloat16)
BIG = -1e30
GQA = "enable_gqa" in str(torch.ops.aten.scaled_dot_product_attention.default._schema)


#: one step back from the softmax to q @ kᵀ: (node, what it does to the scores: a mask
#: term, a constant scale or nothing, why it stops the match or None)
_Step = tuple[fx.Node, "Term | float | None", str | None]


@dataclass
class Attention:
    q: fx.Node
    k: fx.Node | None  # None: k is stored transposed, as `kt`
    kt: fx.Node
    v: fx.Node
    scale: float
    terms: list[Term]
    nodes: list[fx.Node]  # every node the rewrite removes, `out` last
    scores: fx.Node
    softmax: fx.Node
    out: fx.Node
    safe: bool  # _safe_softmax: a row with every key masked gives 0, as SDPA does
    groups: int = 1  # query heads per kv head when k and v are repeated (enable_gqa)
    unmasked: bool = False  # the terms are static and add 0 everywhere: no mask
    reasons: list[tuple[fx.Node, str]] = field(default_factory=list)


def _matmul(n: Argument) -> bool:
    return (
        isinstance(n, fx.Node)
        and raw_name(n) in _MATMULS
        and len(n.args) == 2
        and all(isinstance(a, fx.Node) for a in n.args)
    )


def _dropout(n: fx.Node) -> str | None:
    """None for an eval-mode or p=0 dropout (an identity), else why it is not one."""
    mod = module_of(n)
    if mod is not None:
        p, training = getattr(mod, "p", 0.0), mod.training
    elif raw_name(n) == "native_dropout":
        return f"{n.name} is aten.native_dropout, which returns its mask as well"
    else:  # aten.dropout(x, p, train) or F.dropout(x, p=0.5, training=True)
        p = arg(n, 1, "p", 0.5)
        training = arg(n, 2, "train" if is_aten(n) else "training", True)
    if (isinstance(p, (int, float)) and float(p) == 0.0) or training is False:
        return None
    return f"{n.name} is dropout in training mode on the attention weights"


def _passes(n: fx.Node) -> bool:
    kind = op_kind(n)
    if kind in _PASS:
        return True
    return kind == "dropout" and _dropout(n) is None


def _softmax_dim(n: fx.Node) -> object:
    mod = module_of(n)
    if mod is not None:
        return getattr(mod, "dim", None)
    return arg(n, 1, "dim")


def _scaled(gm: fx.GraphModule, n: fx.Node) -> tuple[fx.Node, float] | None:
    """(x, c) for n = x * c or x / c with c a static number, else None."""
    if op_kind(n) not in ("mul", "div") or len(n.args) != 2:
        return None
    a, b = n.args
    x, c = (a, b) if isinstance(a, fx.Node) and number(gm, b) is not None else (b, a)
    if op_kind(n) == "div" and x is not a:
        return None
    f = number(gm, c)
    if not isinstance(x, fx.Node) or f is None or f == 0.0:
        return None
    return x, (1.0 / f if op_kind(n) == "div" else f)


def _back(gm: fx.GraphModule, cur: fx.Node, steps: list[_Step], depth: int = 0) -> fx.Node | None:
    """Walk from the softmax's input back to the q @ kᵀ matmul, recording each step as
    (node, Term | float scale | None, reason or None); None when there is no matmul."""
    if depth > 24 or not isinstance(cur, fx.Node):
        return None
    if _matmul(cur):
        return cur
    kind = op_kind(cur)
    if _passes(cur):
        steps.append((cur, None, None))
        src = cur.args[0] if cur.args else None
        return _back(gm, src, steps, depth + 1) if isinstance(src, fx.Node) else None
    if kind in ("mul", "div") and len(cur.args) == 2:
        sc = _scaled(gm, cur)
        if sc is not None:
            steps.append((cur, sc[1], None))
            return _back(gm, sc[0], steps, depth + 1)
        for x, other in ((cur.args[0], cur.args[1]), (cur.args[1], cur.args[0])):
            if kind == "div" and x is not cur.args[0]:
                continue
            trial: list = []
            found = _back(gm, x, trial, depth + 1) if isinstance(x, fx.Node) else None
            if found is not None:
                why = (
                    f"the scores are {'multiplied' if kind == 'mul' else 'divided'} by "
                    f"{getattr(other, 'name', other)}, {describe_source(other)}, not by a "
                    "constant scale"
                )
                steps += [(cur, None, why), *trial]
                return found
        return None
    if kind == "add" and len(cur.args) == 2 and not cur.kwargs.get("alpha"):
        for x, other in ((cur.args[0], cur.args[1]), (cur.args[1], cur.args[0])):
            trial = []
            found = _back(gm, x, trial, depth + 1) if isinstance(x, fx.Node) else None
            if found is not None:
                if isinstance(other, fx.Node):
                    steps += [(cur, Term("add", other), None), *trial]
                else:
                    why = f"a constant ({other}) is added to the scores"
                    steps += [(cur, None, why), *trial]
                return found
        return None
    if kind == "where" and raw_name(cur).startswith("masked_fill") and len(cur.args) >= 3:
        x, m, v = cur.args[:3]
        kind_, fill = "fill", v
    elif kind == "where" and raw_name(cur) == "where" and len(cur.args) == 3:
        m, a, b = cur.args
        keep = isinstance(a, fx.Node) and number(gm, a) is None
        x, fill, kind_ = (a, b, "keep") if keep else (b, a, "fill")
    else:
        return None
    if not isinstance(x, fx.Node) or not isinstance(m, fx.Node):
        return None
    value = number(gm, fill)
    term = Term(kind_, m, math.nan if value is None else value)
    steps.append((cur, term, None))
    return _back(gm, x, steps, depth + 1)


def _forward(sm: fx.Node) -> tuple[fx.Node | None, list[fx.Node], list[tuple[fx.Node, str]]]:
    """(the p @ v matmul, the nodes between, reasons) from the softmax on."""
    cur = sm
    chain: list[fx.Node] = []
    reasons: list[tuple[fx.Node, str]] = []
    while True:
        users = list(cur.users)
        nxt = [
            u
            for u in users
            if (_matmul(u) and u.args[0] is cur)
            or op_kind(u) in (*_PASS, "dropout")
            or (op_kind(u) == "mul" and len(users) == 1)
        ]
        if len(nxt) != 1:
            return None, chain, reasons
        u = nxt[0]
        others = [x for x in users if x is not u]
        if others:
            names = ", ".join(x.name for x in others[:3])
            reasons.append(
                (
                    sm,
                    f"the attention weights {cur.name} are also read by {names} (the model "
                    "returns or reuses them, as output_attentions does); SDPA does not "
                    "compute them",
                )
            )
        if _matmul(u):
            return u, chain, reasons
        if op_kind(u) == "dropout" and _dropout(u) is not None:
            reasons.append((u, str(_dropout(u))))
        elif op_kind(u) == "mul":
            other = u.args[1] if u.args[0] is cur else u.args[0]
            reasons.append(
                (
                    u,
                    f"the attention weights are multiplied by {getattr(other, 'name', other)} "
                    "(a head mask), which SDPA cannot take",
                )
            )
        chain.append(u)
        cur = u


def _fold_scale(gm: fx.GraphModule, x: fx.Node, nodes: list[fx.Node]) -> tuple[fx.Node, float]:
    """x, seen through a constant scale that only this attention reads."""
    sc = _scaled(gm, x) if len(x.users) == 1 else None
    if sc is None:
        return x, 1.0
    nodes.append(x)
    return sc[0], sc[1]


def read(gm: fx.GraphModule, sm: fx.Node) -> Attention | str | None:
    """The attention around softmax `sm`, a reason it does not qualify, or None when the
    softmax is not between two matmuls."""
    x = arg(sm, 0, "input")
    if not isinstance(x, fx.Node):
        return None
    pv, fwd, reasons = _forward(sm)
    steps: list = []
    qk = _back(gm, x, steps)
    if pv is None or qk is None:
        return None
    xi, si = info(x), info(sm)
    dim = _softmax_dim(sm)
    if xi is None or si is None:
        return f"the shapes around {sm.name} are unknown"
    rank = len(xi.shape)
    if not isinstance(dim, int) or dim % rank != rank - 1:
        return f"{sm.name} is a softmax over dim {dim}, not the last (keys) dim: not attention"
    steps.reverse()  # from the scores to the softmax
    if reasons:
        return reasons[0][1]
    why = next((w for _, _, w in steps if w), None)
    if why:
        return why
    nodes: list[fx.Node] = []
    q0, kt0 = qk.args[0], qk.args[1]
    assert isinstance(q0, fx.Node) and isinstance(kt0, fx.Node)  # _matmul checked
    q, scale = _fold_scale(gm, q0, nodes)
    kt, ks = _fold_scale(gm, kt0, nodes)
    scale *= ks
    k: fx.Node | None = None
    perm, kti = perm_of(kt), info(kt)
    if perm is not None and kti is not None:
        r = len(kti.shape)
        swap = list(range(r))
        swap[-2:] = swap[:-3:-1]
        if perm == swap and isinstance(kt.args[0], fx.Node):
            k = kt.args[0]
            if len(kt.users) == 1:
                nodes.append(kt)
                k, ks = _fold_scale(gm, k, nodes)
                scale *= ks
    terms: list[Term] = []
    for node, what, _ in steps:
        if isinstance(what, float):
            if terms:
                return f"the scores are scaled by {node.name} after the mask is applied"
            scale *= what
        elif isinstance(what, Term):
            terms.append(what)
    escaped = [(n, u) for n in [qk, *(s for s, _, _ in steps)] for u in n.users]
    inside = {qk, *(s for s, _, _ in steps), sm}
    for n, u in escaped:
        if u not in inside:
            return f"the scores {n.name} are also read by {u.name}, outside the attention"
    v = pv.args[1]
    assert isinstance(v, fx.Node)  # _matmul checked both operands are nodes
    why = _shapes(q, k, kt, v, qk, pv, terms)
    if why:
        return why
    groups = 1
    kr, vr = (repeated(k) if k is not None else None), repeated(v)
    if GQA and kr is not None and vr is not None and kr[1] == vr[1]:
        k, v, groups = kr[0], vr[0], kr[1]
        nodes += kr[2] + vr[2]
    nodes += [qk, *(s for s, _, _ in steps), sm, *fwd, pv]
    return Attention(
        q,
        k,
        kt,
        v,
        scale,
        terms,
        list(dict.fromkeys(nodes)),
        qk,
        sm,
        pv,
        raw_name(sm) == "_safe_softmax",
        groups,
    )


def _shapes(
    q: fx.Node,
    k: fx.Node | None,
    kt: fx.Node,
    v: fx.Node,
    qk: fx.Node,
    pv: fx.Node,
    terms: list[Term],
) -> str | None:
    """Why q, k, v and the mask cannot go to SDPA as they are; None when they can."""
    qs, kts, vs, ss = shapes_seen(q), shapes_seen(kt), shapes_seen(v), shapes_seen(qk)
    qi, vi, oi = info(q), info(v), info(pv)
    if not qs or not kts or not vs or qi is None or vi is None or oi is None:
        return "the shapes of q, k and v are unknown"
    if qi.dtype != vi.dtype or info(kt) is None or info(kt).dtype != qi.dtype:  # type: ignore[union-attr]
        return f"q, k and v have different dtypes ({qi.dtype}, {vi.dtype})"
    if oi.dtype != qi.dtype:
        return f"the output is {oi.dtype}, not q's {qi.dtype}: the pattern casts in between"
    if not qi.dtype.is_floating_point:
        return f"q is {qi.dtype}, not a floating-point tensor"
    for a, b, c in zip(qs, kts, vs, strict=False):
        if len(a) < 3 or not len(a) == len(b) == len(c):
            return "q, k and v are not tensors of one rank >= 3 ([..., seq, head_dim])"
        if a[:-2] != b[:-2] or a[:-2] != c[:-2]:
            return (
                f"q, k and v have different batch or head dims ({list(a[:-2])}, "
                f"{list(b[:-2])}, {list(c[:-2])}): the matmul broadcasts, SDPA does not"
            )
        if b[-1] != c[-2] or a[-1] != b[-2]:
            return "the key and value lengths or head dims do not line up"
    for t in terms:
        ti = info(t.tensor)
        if ti is None:
            return f"the shape of the mask {t.tensor.name} is unknown"
        if t.kind == "add" and not ti.dtype.is_floating_point:
            return f"the mask {t.tensor.name} added to the scores is {ti.dtype}, not a float"
        if t.kind != "add" and not (t.value == -math.inf or t.value <= BIG):
            return (
                f"the masked scores are set to {t.value}, {'not a number' if math.isnan(t.value) else 'not -inf or a value below -1e30'}: "
                "a row with every key masked would average v in eager and not in SDPA"
            )
        for m, s in zip(shapes_seen(t.tensor), ss, strict=False):
            try:
                ok = len(m) <= len(s) and tuple(torch.broadcast_shapes(m, s)) == s
            except RuntimeError:
                ok = False
            if not ok:
                return (
                    f"the mask {t.tensor.name} of shape {list(m)} does not broadcast to the "
                    f"scores' {list(s)}"
                )
    return None
