"""fusion.parallel_linear: Linears reading the same input -> one wide Linear.

Two or more Linears that read the same input (Q, K and V projections) read x
once each; one Linear with the weights stacked reads x once, runs one larger
(better-shaped) GEMM, and hands each original reader a slice of its output.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, copy_meta, is_aten, op_kind, raw_name
from opswap.graph.shapes import info, shapes_seen
from opswap.rules._cost import saving
from opswap.rules._edits import drop_dead_attrs, erase, fresh_path, new_const
from opswap.rules._matching import input_of
from opswap.rules._weights import Weighted, weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

aten = torch.ops.aten


def _leaf(w: Weighted) -> tuple[str, str]:
    """(parent path, leaf name) of a linear, to name the merged one ('attn', 'query')."""
    node = w.node
    if node.op == "call_module":
        path = str(node.target)
    else:
        wn = arg(node, 1, "weight")
        path = (
            str(wn.target).rpartition(".")[0]
            if isinstance(wn, fx.Node) and wn.op == "get_attr" and "." in str(wn.target)
            else node.name
        )
    parent, _, leaf = path.rpartition(".")
    return parent, leaf


def _merged_name(members: list[Weighted]) -> str:
    parts = [_leaf(w) for w in members]
    parents = {p for p, _ in parts}
    joined = "_".join(leaf for _, leaf in parts)
    parent = parents.pop() if len(parents) == 1 else ""
    return f"{parent}.{joined}" if parent else joined


def _viewable(piece_shape: Sequence[int], wide_last: int, out_shape: Sequence[int]) -> bool:
    """Whether a last-dim slice of a contiguous [..., wide_last] tensor can be .view-ed
    to out_shape (checked on meta tensors, no data)."""
    strides, acc = [], 1
    for s in reversed((*piece_shape[:-1], wide_last)):
        strides.append(acc)
        acc *= s
    try:
        torch.empty_strided(piece_shape, tuple(reversed(strides)), device="meta").view(out_shape)
        return True
    except RuntimeError:
        return False


def _in_graph_order(start: fx.Node, nodes: list[fx.Node]) -> list[fx.Node]:
    """`nodes`, all after `start`, sorted by their place in the graph (walked from start)."""
    todo, out, cur = set(nodes), [], start
    while todo and cur.op != "root":
        if cur in todo:
            out.append(cur)
            todo.discard(cur)
        cur = cur.next
    return out


@register
class ParallelLinear(Rule):
    """Linears reading the same input (Q, K, V) -> one wide Linear, then slices.

    The input is read once instead of k times, and one GEMM with N1 + ... + Nk
    outputs uses the machine better than k thin ones. Each original reader gets
    a view of the wide output (one split, no copy); a reader that must .view() a
    slice whose strides forbid it gets a .contiguous() first. Linears with and
    without bias can merge: the bias-free ones get a zero bias (x + 0 is exact).
    Linears of different dtypes or devices stay apart (reported).
    """

    name = "fusion.parallel_linear"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    relieves = ("memory:matmul",)
    description = (
        "Several Linears reading the same input (e.g. Q, K, V projections) -> one "
        "Linear with stacked weights and a slice per reader: the input is read once, "
        "and one larger GEMM replaces k small ones."
    )
    # Linears that matmul_add creates, or whose BatchNorm linear_bn folds, can merge too;
    # after merging, a BatchNorm would follow a slice, which linear_bn cannot fold
    after = ("fusion.matmul_add", "fusion.linear_bn")

    anchors = ("linear",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> list[Found | Refused] | None:
        """At the first Linear reading its input: the Linears that merge, and why others
        reading the same input do not."""
        x = input_of(node)
        if x is None:
            return None
        nodes = _in_graph_order(
            x, [u for u in x.users if op_kind(u) == "linear" and input_of(u) is x]
        )
        if len(nodes) < 2 or nodes[0] is not node:
            return None
        out: list[Found | Refused] = []
        ok: list[Weighted] = []
        for n in nodes:
            w = weighted(gm, n)
            if isinstance(w, str):
                out.append(
                    Refused(f"{w}, so it cannot merge with the other Linears reading {x.name}", n)
                )
            else:
                ok.append(w)
        by_kind: dict[tuple, list[Weighted]] = defaultdict(list)
        for w in ok:
            by_kind[(w.weight.dtype, w.weight.device)].append(w)
        members = max(by_kind.values(), key=len, default=[])
        for w in ok:
            if w not in members and members:
                ref = members[0]
                out.append(
                    Refused(
                        f"{w.node.name} is {str(w.weight.dtype).removeprefix('torch.')} on "
                        f"{w.weight.device} while {ref.node.name} is "
                        f"{str(ref.weight.dtype).removeprefix('torch.')} on {ref.weight.device}; "
                        "Linears merge only with the same dtype and device",
                        w.node,
                    )
                )
        if len(members) < 2:
            return out
        names = [w.node.name for w in members]
        zero = [w.node.name for w in members if w.bias is None]
        desc = f"merge {', '.join(names)} (all reading {x.name}) into one Linear"
        if zero and len(zero) < len(members):
            desc += f"; {', '.join(zero)} get a zero bias"
        member_nodes = tuple(w.node for w in members)
        out.append(
            Found(
                member_nodes,
                desc,
                dict(x=x, members=members),
                outputs=member_nodes,
                record=dict(input=x.name, members=names),
            )
        )
        return out

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        x, members = found["x"], found["members"]
        weight = torch.cat([w.weight.detach() for w in members], 0)
        with_bias = any(w.bias is not None for w in members)
        bias = (
            torch.cat(
                [
                    w.bias.detach()
                    if w.bias is not None
                    else torch.zeros(
                        w.weight.shape[0], dtype=w.weight.dtype, device=w.weight.device
                    )
                    for w in members
                ]
            )
            if with_bias
            else None
        )
        order = list(gm.graph.nodes)
        first = min((w.node for w in members), key=order.index)
        name = _merged_name(members)
        grad = members[0].weight.requires_grad
        if all(w.node.op == "call_module" for w in members):
            lin = nn.Linear(
                weight.shape[1],
                weight.shape[0],
                bias=with_bias,
                dtype=weight.dtype,
                device=weight.device,
            )
            lin.weight = nn.Parameter(weight, requires_grad=grad)
            if bias is not None:
                lin.bias = nn.Parameter(bias, requires_grad=grad)
            target = fresh_path(gm, name)
            gm.add_submodule(target, lin)
            with gm.graph.inserting_before(first):
                wide = gm.graph.call_module(target, (x,))
        else:
            wn = new_const(gm, first, f"{name}.weight", weight)
            args = (
                (x, wn, new_const(gm, first, f"{name}.bias", bias)) if bias is not None else (x, wn)
            )
            fn = aten.linear.default if any(is_aten(w.node) for w in members) else F.linear
            with gm.graph.inserting_before(first):
                wide = gm.graph.call_function(fn, args)
        self._slice(gm, wide, members, weight.shape[0])
        drop_dead_attrs(gm, erase(gm, [w.node for w in members]))

    def _slice(
        self, gm: fx.GraphModule, wide: fx.Node, members: list[Weighted], total: int
    ) -> None:
        # one split into views (a single dispatch) rather than k narrows (k dispatches)
        aten_graph = any(is_aten(w.node) for w in members)
        split = aten.split_with_sizes.default if aten_graph else torch.split
        sizes = [int(w.weight.shape[0]) for w in members]
        with gm.graph.inserting_after(wide):
            parts = gm.graph.call_function(split, (wide, sizes, -1))
        offset, cursor = 0, parts
        for i, w in enumerate(members):
            n = w.weight.shape[0]
            with gm.graph.inserting_after(cursor):
                piece = gm.graph.call_function(operator.getitem, (parts, i))
            cursor = piece
            copy_meta(piece, w.node)
            w.node.replace_all_uses_with(piece)
            shapes = shapes_seen(piece)
            for user in list(piece.users):
                if raw_name(user) not in ("view", "_unsafe_view"):
                    continue
                outs = shapes_seen(user)
                if (
                    shapes
                    and len(shapes) == len(outs)
                    and all(_viewable(sh, total, o) for sh, o in zip(shapes, outs, strict=True))
                ):
                    continue  # a view of the slice works at the example and every probe
                with gm.graph.inserting_before(user):
                    if aten_graph:
                        c = gm.graph.call_function(
                            aten.clone.default, (piece,), {"memory_format": torch.contiguous_format}
                        )
                    else:
                        c = gm.graph.call_method("contiguous", (piece,))
                user.replace_input_with(piece, c)
            offset += n

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        nodes, x = list(found.nodes), found["x"]
        x_info = info(x)
        x_bytes = x_info.nbytes if x_info else 0
        gone = [node_cost(n) for n in nodes]
        # same FLOPs, same weights and outputs; x is read once instead of k times
        wide = NodeCost(
            sum(c.flops for c in gone), sum(c.bytes for c in gone) - (len(nodes) - 1) * x_bytes
        )
        # the wide output is cut back into k outputs by one split (views: one dispatch)
        split, note = NodeCost(0, 0), ""
        if target.kind == "edge":
            # an edge delegate has no strided views: XNNPACK writes each part of the split
            # as a copy (static_slice), so every output is written and read once more. On
            # the 2-core VM, zoo:gpt's .pte without the merge ran 1.02-1.05x LiteRT's time
            # against 1.11-1.20x with it (same interleaved runs)
            out_bytes = sum(i.nbytes for i in map(info, nodes) if i is not None)
            split = NodeCost(0, 2 * out_bytes)
            note = f"; on {target.name} the split copies each of the {len(nodes)} outputs"
        return saving(
            target,
            nodes,
            [wide, split],
            f"{len(nodes)} GEMMs -> 1: {x.name} read once instead of {len(nodes)} times{note}",
        )
