"""attention.sdpa: hand-written attention (q @ kᵀ, scale, masks, softmax, @ v), recognised
on what it computes (rules/attention/_match.py), -> `aten.scaled_dot_product_attention`.

Written out, the [B, H, S_q, S_k] scores are written by the first matmul, read and
written again by the scale, by each mask or bias added, by the softmax (and its casts),
and read by the second matmul: 2 + 2 per elementwise step passes over S_q * S_k values
per head. SDPA's fused kernels (flash on CPU and CUDA, memory-efficient, cuDNN) keep
the scores in tiles and move q, k, v, the mask and the output only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import copy_meta
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import drop_dead_attrs, erase
from opswap.rules.attention import _static
from opswap.rules.attention._match import Attention, read
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

aten = torch.ops.aten


def _mask_kind(att: Attention, causal: bool) -> str:
    if causal:
        return "causal"
    if not att.terms or att.unmasked:
        return "no mask"
    if all(t.kind != "add" for t in att.terms) and all(t.value == -math.inf for t in att.terms):
        return "boolean mask"
    return "additive mask"


def _ancestors(nodes: Iterable[fx.Node]) -> list[fx.Node]:
    out, todo = [], list(nodes)
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen or n.op in ("placeholder", "output"):
            continue
        seen.add(n)
        out.append(n)
        todo += n.all_input_nodes
    return out


@register
class SDPA(Rule):
    """Hand-written attention -> scaled_dot_product_attention, with the scale passed
    explicitly, `is_causal=True` where the mask is exactly causal at every shape the
    capture ran (and nothing else is added), an explicit boolean or additive mask
    otherwise. Exact up to rounding: SDPA computes the same softmax(q kᵀ · scale + mask) v
    (in tiles, its sums in another order). One difference of semantics is handled: a row
    whose every key is masked with -inf is NaN in eager and 0 in SDPA (torch >= 2.5), so
    the rewrite sets such rows back to NaN unless the mask is causal."""

    name = "attention.sdpa"
    training = True
    family = "attention"
    chapter = 8
    exactness = "exact"
    targets = ("cpu", "cuda")
    phase = "main"
    after = ("layout.drop_*",)
    #: fusions and layout rewrites would eat pieces of the pattern (the scores' add, the
    #: transpose of k, the softmax); flash consumes the SDPA calls made here
    before = (
        "fusion.*",
        "layout.cancel_transpose",
        "layout.collapse_view",
        "layout.permute_matmul",
        "softmax.*",
        "attention.flash",
    )
    relieves = ("memory:softmax", "memory:elementwise", "compute:matmul")
    anchors = ("softmax",)
    description = (
        "Hand-written attention (q @ k^T, scale as mul/div or sqrt(d), additive, boolean, "
        "causal or sliding-window masks, position bias, softmax with casts, eval dropout, "
        "@ v; GQA repeats) -> aten.scaled_dot_product_attention: the [B,H,S,S] scores are "
        "no longer written and re-read by each op."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        att = read(gm, node)
        if att is None or isinstance(att, str):
            return Refused(att) if isinstance(att, str) else None
        causal = _static.causal(gm, att.terms, att.scores)
        if not causal and _static.hides_nothing(gm, att.terms, att.scores):
            att.unmasked = True
        si = info(att.scores)
        shape = "x".join(map(str, si.shape)) if si is not None else "?"
        kind = _mask_kind(att, causal)
        gqa = f", GQA {att.groups}:1" if att.groups > 1 else ""
        return Found(
            att.nodes,
            f"attention at {att.softmax.name} (scores {shape}, scale {att.scale:.4g}, {kind}"
            f"{gqa}; {len(att.nodes)} ops) -> scaled_dot_product_attention",
            dict(att=att, causal=causal),
            key=f"{att.scores.name}..{att.out.name}",
            outputs=(att.out,),
            record=dict(scale=att.scale, mask=kind, groups=att.groups, softmax=att.softmax.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        att: Attention = found["att"]
        causal: bool = found["causal"]
        g = gm.graph
        dtype = info(att.q).dtype if info(att.q) is not None else torch.float32  # type: ignore[union-attr]
        with g.inserting_before(att.out):
            k = (
                att.k
                if att.k is not None
                else g.call_function(aten.transpose.int, (att.kt, -2, -1))
            )
            static = causal or att.unmasked
            mask, rows = (None, None) if static else self._mask(g, att, dtype)
            kwargs: dict[str, fx.node.Argument] = {"scale": att.scale}
            if att.groups > 1:
                kwargs["enable_gqa"] = True
            out = g.call_function(
                aten.scaled_dot_product_attention.default,
                (att.q, k, att.v, mask, 0.0, causal),
                kwargs,
            )
            copy_meta(out, att.out)
            if rows is not None and not att.safe:
                out = rows(out)
                copy_meta(out, att.out)
        att.out.replace_all_uses_with(out)
        dead = erase(gm, att.nodes)
        if static:  # the mask's own ops (a triu crop, the masking utilities) now read by none
            dead += erase(gm, _ancestors(t.tensor for t in att.terms))
        drop_dead_attrs(gm, dead)

    @staticmethod
    def _mask(
        g: fx.Graph, att: Attention, dtype: torch.dtype
    ) -> tuple[fx.Node | None, Callable[[fx.Node], fx.Node] | None]:
        """(attn_mask, fix) for the terms: a bool mask of the keys kept where every term
        fills with -inf, an additive float mask otherwise; `fix(out)` makes the rows
        eager would leave NaN (every key at -inf) NaN again."""
        terms = att.terms
        if not terms:
            return None, None
        if all(t.kind != "add" and t.value == -math.inf for t in terms):
            keep = None
            for t in terms:
                k = (
                    t.tensor
                    if t.kind == "keep"
                    else g.call_function(aten.logical_not.default, (t.tensor,))
                )
                keep = k if keep is None else g.call_function(aten.logical_and.default, (keep, k))
            rows = g.call_function(aten.any.dim, (keep, -1, True))
            return keep, lambda out: g.call_function(aten.where.ScalarOther, (rows, out, math.nan))
        add = None
        for t in terms:
            if t.kind == "add":
                term = t.tensor
                if info(term) is not None and info(term).dtype != dtype:  # type: ignore[union-attr]
                    term = g.call_function(aten.to.dtype, (term, dtype))
                add = term if add is None else g.call_function(aten.add.Tensor, (add, term))
                continue
            base = (
                add
                if add is not None
                else g.call_function(aten.scalar_tensor.default, (0.0,), dict(dtype=dtype))
            )
            if t.kind == "fill":  # where(m, value, base)
                add = g.call_function(aten.where.ScalarSelf, (t.tensor, t.value, base))
            else:  # keep: where(c, base, value)
                add = g.call_function(aten.where.ScalarOther, (t.tensor, base, t.value))
        dead = g.call_function(
            aten.all.dim, (g.call_function(aten.isneginf.default, (add,)), -1, True)
        )
        return add, lambda out: g.call_function(aten.where.ScalarSelf, (dead, math.nan, out))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        att: Attention = found["att"]
        removed = att.nodes
        ins = [att.q, att.kt if att.k is None else att.k, att.v]
        mask = [] if found["causal"] or att.unmasked else [t.tensor for t in att.terms]
        nbytes = sum(i.nbytes for i in map(info, [*ins, *mask, att.out]) if i is not None)
        flops = sum(node_cost(n).flops for n in removed)
        si = info(att.scores)
        note = (
            f"{len(removed)} ops -> 1 SDPA: the scores ({si}) are no longer written to memory "
            "and read back by the scale, mask, softmax and second matmul"
        )
        return saving(target, removed, [NodeCost(flops, nbytes)], note)
