"""fusion.batch_matmul: independent matmuls of the same shapes -> one batched matmul.

A loop-unrolled model (a head or a branch per iteration) multiplies k pairs of
equally-shaped matrices one after the other: k small GEMM calls, each too small to
fill the machine, each paying a dispatch. Stacking the k left operands and the k right
operands and running one matmul over the new leading dim gives the same products (each
[k]-slice is one of the original GEMMs, summed in the same order), then `unbind` hands
each reader its own slice as a view. Operands that are constants (per-branch weights)
are stacked once, at rewrite; the others are stacked at run time, a copy the
prediction counts, so the planner takes the site only where the dispatches saved
outweigh it.

What it does not do: re-block one large GEMM into tiles (the GEMM library and the
Triton GEMM of rules/matmul/ choose their tiles), group matmuls of different shapes
(a grouped GEMM kernel), or batch matmuls that depend on one another.
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Any

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import op_kind, raw_name
from opswap.graph.shapes import info, shapes_seen
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase, new_const
from opswap.rules._matching import const
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register

_NAMES = ("matmul", "__matmul__", "bmm", "mm")


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) of a plain two-operand matmul whose operands are at least 2-d, else None."""
    if op_kind(node) != "matmul" or raw_name(node) not in _NAMES or len(node.args) != 2:
        return None
    if node.kwargs:
        return None
    a, b = node.args
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None
    ai, bi = info(a), info(b)
    if ai is None or bi is None or len(ai.shape) < 2 or len(bi.shape) < 2:
        return None
    return a, b


def _signature(node: fx.Node) -> tuple[Any, ...] | None:
    """The operands' shapes at the example and every probe: equal signatures multiply
    equally shaped matrices wherever the model runs."""
    ops = _operands(node)
    if ops is None:
        return None
    a, b = ops
    sa, sb = shapes_seen(a), shapes_seen(b)
    if not sa or not sb:
        return None
    return tuple(sa), tuple(sb)


def _kind(node: fx.Node) -> tuple[Any, ...]:
    ops = _operands(node)
    assert ops is not None
    ai, bi = info(ops[0]), info(ops[1])
    assert ai is not None and bi is not None
    return ai.dtype, bi.dtype


def _downstream(node: fx.Node) -> set[fx.Node]:
    """Every node that reads `node`'s output, directly or through others."""
    seen: set[fx.Node] = set()
    todo = deque(node.users)
    while todo:
        n = todo.popleft()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen


def _groups(gm: fx.GraphModule, sig: tuple[Any, ...]) -> list[list[fx.Node]]:
    """The matmuls of signature `sig` and the same dtypes, partitioned greedily in graph
    order into groups that can run as one: no member reads another's output, and every
    operand is ready before the first reader of any member's output."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    cands = [n for n in gm.graph.nodes if op_kind(n) == "matmul" and _signature(n) == sig]
    # each group: [members, everything downstream of them, latest operand, first reader]
    groups: list[list[Any]] = []
    for n in cands:
        ops = _operands(n)
        assert ops is not None
        ready = max(order[ops[0]], order[ops[1]])
        first_use = min((order[u] for u in n.users), default=len(order))
        for g in groups:
            members, down, last_op, first_read = g
            if n in down or _kind(n) != _kind(members[0]):
                continue
            if max(last_op, ready) >= min(first_read, first_use):
                continue
            members.append(n)
            g[1] = down | _downstream(n)
            g[2], g[3] = max(last_op, ready), min(first_read, first_use)
            break
        else:
            groups.append([[n], _downstream(n), ready, first_use])
    return [g[0] for g in groups]


@register
class BatchMatmul(Rule):
    """Independent matmuls with equally shaped operands -> stack, one matmul, unbind."""

    name = "fusion.batch_matmul"
    training = True
    family = "fusion"
    chapter = 5
    exactness = "exact"
    relieves = ("compute:matmul", "memory:matmul")
    description = (
        "Independent matmuls of the same shapes (per-head or per-branch GEMMs of an unrolled "
        "loop) -> one batched matmul over stacked operands, each reader a slice: one GEMM "
        "call instead of k; constant operands are stacked once."
    )
    after = ("fusion.parallel_linear", "fusion.matmul_add")
    anchors = ("matmul",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        sig = _signature(node)
        if sig is None:
            return None
        groups = _groups(gm, sig)
        mine = next(g for g in groups if node in g)
        if mine[0] is not node:
            return None
        if len(mine) == 1:
            same = [g[0] for g in groups if g is not mine and len(g) > 0]
            other = next((m for m in same if _kind(m) != _kind(node)), None)
            if other is not None:
                mine_d, other_d = (
                    " by ".join(str(t).removeprefix("torch.") for t in _kind(n))
                    for n in (node, other)
                )
                return Refused(
                    f"{node.name} multiplies {mine_d} while {other.name}, of the same shapes, "
                    f"multiplies {other_d}; only matmuls of the same dtypes batch together"
                )
            return None
        a_shape, b_shape = sig[0][0], sig[1][0]
        names = [n.name for n in mine]
        return Found(
            tuple(mine),
            f"batch {', '.join(names)} ({len(mine)} matmuls of {list(a_shape)} x "
            f"{list(b_shape)}) into one matmul over stacked operands",
            dict(members=list(mine)),
            outputs=tuple(mine),
            record=dict(members=names, a=list(a_shape), b=list(b_shape)),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        members: list[fx.Node] = found["members"]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        readers = [u for m in members for u in m.users]
        at = min([*readers, members[-1]], key=order.__getitem__)
        like = members[0]
        graph = gm.graph
        ops = _operands(like)
        assert ops is not None
        ranks = [len(shapes_seen(n)[0]) for n in ops]
        top = max(ranks)
        stacked = []
        for side in (0, 1):
            nodes = [m.args[side] for m in members]
            consts = [const(gm, n) for n in nodes]
            # the lower-rank operand gets size-1 dims after k, so that the original
            # broadcast of its batch dims against the other's is kept: [k, 1, .., K, N]
            ones = top - ranks[side]
            if all(c is not None for c in consts):
                tensor = torch.stack([c.detach() for c in consts if c is not None])
                tensor = tensor.reshape(len(nodes), *([1] * ones), *tensor.shape[1:])
                stacked.append(new_const(gm, at, f"{like.name}_batched_{'ab'[side]}", tensor))
                continue
            with graph.inserting_before(at):
                node = call(graph, like, "stack", (nodes, 0))
                for _ in range(ones):
                    node = call(graph, like, "unsqueeze", (node, 1))
            stacked.append(node)
        with graph.inserting_before(at):
            prod = call(graph, like, "matmul", tuple(stacked))
            parts = call(graph, like, "unbind.int", (prod, 0))
            pieces = [
                graph.call_function(operator.getitem, (parts, i)) for i in range(len(members))
            ]
        for m, p in zip(members, pieces, strict=True):
            p.meta.update({k: v for k, v in m.meta.items() if k in ("tensor_meta", "val")})
            m.replace_all_uses_with(p)
        drop_dead_attrs(gm, erase(gm, members))

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        members: list[fx.Node] = found["members"]
        gone = [node_cost(n) for n in members]
        flops = sum(c.flops for c in gone)
        added = [NodeCost(flops, sum(c.bytes for c in gone))]
        copies = 0
        for side in (0, 1):
            nodes = [m.args[side] for m in members]
            if any(const(gm, n) is None for n in nodes):
                size = sum(i.nbytes for i in (info(n) for n in nodes) if i is not None)
                added.append(NodeCost(0, 2 * size))  # the stack: read k operands, write one
                copies += 1
        note = f"{len(members)} matmuls -> 1 batched"
        if copies:
            note += f", plus {copies} stack{'s' if copies > 1 else ''} of the operands"
        return saving(target, members, added, note)
