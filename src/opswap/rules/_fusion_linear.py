"""fusion.matmul_add and fusion.parallel_linear: GEMMs that should be one GEMM call.

`x @ W + b` with constant W and b runs a GEMM that writes x @ W, then an add
that reads it back with b and writes the sum: one linear (GEMM with the bias in
its epilogue) never materialises x @ W.

Two or more Linears that read the same input (Q, K and V projections) read x
once each; one Linear with the weights stacked reads x once, runs one larger
(better-shaped) GEMM, and hands each original reader a slice of its output.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, copy_meta, is_aten, op_kind, raw_name
from opswap.graph.shapes import info, shapes_seen
from opswap.rules._access import (
    Weighted,
    const,
    describe_source,
    input_of,
    shared_reason,
    weighted,
)
from opswap.rules._fusion_cost import saving
from opswap.rules._fusion_edit import drop_dead_attrs, erase, fresh_path, new_const
from opswap.rules.base import Estimate, Miss, Rule, Site, node_by_name
from opswap.rules.registry import register

aten = torch.ops.aten

_MATMUL_NAMES = {"matmul", "__matmul__", "mm"}


def _bias_vector(b, n: int, out_ndim: int, dtype: torch.dtype) -> torch.Tensor | str:
    """b as a length-n bias vector when adding it broadcasts along the last dim only."""
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return torch.full((n,), float(b), dtype=dtype)
    if b.dtype != dtype:
        return f"the bias is {b.dtype} but x @ W is {dtype}, so the add would change the type"
    if b.dim() > out_ndim or any(s != 1 for s in b.shape[:-1]) or (
            b.dim() and b.shape[-1] not in (1, n)):
        return (f"the added constant has shape {list(b.shape)}, which is not a bias along the "
                f"last dim (expected [{n}])")
    return b.reshape(-1).expand(n).clone() if b.dim() else b.reshape(1).expand(n).clone()


@register
class MatMulAdd(Rule):
    """x @ W + b, with W [K, N] and b constants -> linear(x, W.T, b).

    W is transposed once at rewrite time into Linear's [N, K] layout; the add
    moves into the GEMM's epilogue, so x @ W is never written out and re-read.
    """

    name = "fusion.matmul_add"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    description = ("x @ W + b with constant W [K, N] and bias b -> linear(x, W^T, b): the bias "
                   "is added in the GEMM epilogue, so x @ W is not written out and re-read.")

    def _check(self, gm: fx.GraphModule, add: fx.Node):
        """(matmul, x, W, bias vector) or a reason; None when it is not a near-match."""
        if op_kind(add) != "add" or len(add.args) != 2:
            return None
        pair = next(((a, b) for a, b in (add.args, add.args[::-1]) if isinstance(a, fx.Node)
                     and op_kind(a) == "matmul" and raw_name(a) in _MATMUL_NAMES), None)
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
            return f"W of {mm.name} is not a constant: it is {describe_source(w_node)}"
        if b_t is None:
            return f"the bias added by {add.name} is not a constant: it is {describe_source(b)}"
        if add.kwargs.get("alpha", 1) != 1:
            return f"{add.name} scales its operand (alpha), which a linear's bias cannot express"
        if w.dim() != 2:
            return f"W of {mm.name} is {w.dim()}-D; a linear needs a 2-D weight"
        out = info(mm)
        if out is None:
            return f"the shape of {mm.name} is unknown"
        bias = _bias_vector(b_t, w.shape[1], len(out.shape), out.dtype)
        if isinstance(bias, str):
            return bias
        shared = shared_reason(mm, {add}, "the add cannot move into its epilogue")
        if shared:
            return shared
        return mm, x, w, bias

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        found: list[Site | Miss] = []
        for node in gm.graph.nodes:
            checked = self._check(gm, node)
            if checked is None:
                continue
            if isinstance(checked, str):
                found.append(self.miss(node, checked))
                continue
            mm = checked[0]
            found.append(self.site(f"{mm.name}+{node.name}", [mm, node],
                                   f"{mm.name} + {node.name} -> linear", matmul=mm.name,
                                   add=node.name))
        return found

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        add = node_by_name(gm, site.data["add"])
        mm, x, w, bias = self._check(gm, add)
        w_node = mm.args[1]
        base = (str(w_node.target) if isinstance(w_node, fx.Node) and w_node.op == "get_attr"
                else f"{mm.name}_weight")
        wt = new_const(gm, mm, f"{base}_t", w.detach().t().contiguous())
        b_node = add.args[1] if add.args[0] is mm else add.args[0]
        b_given = const(gm, b_node) if isinstance(b_node, fx.Node) else None
        if b_node is not None and isinstance(b_node, fx.Node) and b_node.op == "get_attr" \
                and b_given is not None and tuple(b_given.shape) == tuple(bias.shape):
            b = b_node  # already a bias vector: keep it (and its name)
        else:
            b = new_const(gm, mm, f"{base}_bias", bias.detach().clone())
        fn = aten.linear.default if is_aten(mm) else F.linear
        with gm.graph.inserting_before(add):
            new = gm.graph.call_function(fn, (x, wt, b))
        copy_meta(new, add)
        add.replace_all_uses_with(new)
        drop_dead_attrs(gm, erase(gm, [add, mm]))

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        add = node_by_name(gm, site.data["add"])
        out = info(add)
        bias_bytes = out.nbytes // max(out.numel, 1) * out.shape[-1] if out and out.shape else 0
        # the add's arithmetic happens in the GEMM epilogue, which also reads the bias once
        epilogue = NodeCost(node_cost(add).flops, bias_bytes)
        return saving(target, [add], [epilogue], "bias added in the GEMM epilogue: x @ W is "
                      "not written out and re-read")


# --------------------------------------------------------------------------- parallel Linears


def _leaf(w: Weighted) -> tuple[str, str]:
    """(parent path, leaf name) of a linear, to name the merged one ('attn', 'query')."""
    node = w.node
    if node.op == "call_module":
        path = str(node.target)
    else:
        wn = arg(node, 1, "weight")
        path = str(wn.target).rpartition(".")[0] if isinstance(wn, fx.Node) and \
            wn.op == "get_attr" and "." in str(wn.target) else node.name
    parent, _, leaf = path.rpartition(".")
    return parent, leaf


def _merged_name(members: list[Weighted]) -> str:
    parts = [_leaf(w) for w in members]
    parents = {p for p, _ in parts}
    joined = "_".join(leaf for _, leaf in parts)
    parent = parents.pop() if len(parents) == 1 else ""
    return f"{parent}.{joined}" if parent else joined


def _viewable(piece_shape, wide_last: int, out_shape) -> bool:
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


@register
class ParallelLinear(Rule):
    """Linears reading the same input (Q, K, V) -> one wide Linear, then slices.

    The input is read once instead of k times, and one GEMM with N1 + ... + Nk
    outputs uses the machine better than k thin ones. Each original reader gets
    a narrow() view of the wide output (no copy); a reader that must .view() a
    slice whose strides forbid it gets a .contiguous() first. Linears with and
    without bias can merge: the bias-free ones get a zero bias (x + 0 is exact).
    Linears of different dtypes or devices stay apart (reported).
    """

    name = "fusion.parallel_linear"
    family = "fusion"
    chapter = 4
    exactness = "exact"
    description = ("Several Linears reading the same input (e.g. Q, K, V projections) -> one "
                   "Linear with stacked weights and a slice per reader: the input is read once, "
                   "and one larger GEMM replaces k small ones.")

    def _groups(self, gm: fx.GraphModule):
        """{input: [Weighted]} of mergeable linears, plus misses."""
        misses: list[Miss] = []
        groups: dict[fx.Node, list[Weighted]] = {}
        readers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for node in gm.graph.nodes:
            if op_kind(node) == "linear" and input_of(node) is not None:
                readers[input_of(node)].append(node)
        for x, nodes in readers.items():
            if len(nodes) < 2:
                continue
            ok: list[Weighted] = []
            for n in nodes:
                w = weighted(gm, n)
                if isinstance(w, str):
                    misses.append(self.miss(n, f"{w}, so it cannot merge with the other Linears "
                                               f"reading {x.name}"))
                else:
                    ok.append(w)
            by_kind: dict[tuple, list[Weighted]] = defaultdict(list)
            for w in ok:
                by_kind[(w.weight.dtype, w.weight.device)].append(w)
            main = max(by_kind.values(), key=len, default=[])
            for w in ok:
                if w not in main and main:
                    ref = main[0]
                    misses.append(self.miss(w.node, (
                        f"{w.node.name} is {str(w.weight.dtype).removeprefix('torch.')} on "
                        f"{w.weight.device} while {ref.node.name} is "
                        f"{str(ref.weight.dtype).removeprefix('torch.')} on {ref.weight.device}; "
                        "Linears merge only with the same dtype and device")))
            if len(main) >= 2:
                groups[x] = main
        return groups, misses

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        groups, misses = self._groups(gm)
        found: list[Site | Miss] = list(misses)
        for x, members in groups.items():
            names = [w.node.name for w in members]
            zero = [w.node.name for w in members if w.bias is None]
            desc = f"merge {', '.join(names)} (all reading {x.name}) into one Linear"
            if zero and len(zero) < len(members):
                desc += f"; {', '.join(zero)} get a zero bias"
            found.append(self.site("+".join(names), [w.node for w in members], desc,
                                   input=x.name, members=names))
        return found

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        groups, _ = self._groups(gm)
        x = node_by_name(gm, site.data["input"])
        members = [w for w in groups[x] if w.node.name in site.data["members"]]
        weight = torch.cat([w.weight.detach() for w in members], 0)
        with_bias = any(w.bias is not None for w in members)
        bias = torch.cat([w.bias.detach() if w.bias is not None else
                          torch.zeros(w.weight.shape[0], dtype=w.weight.dtype,
                                      device=w.weight.device) for w in members]) if with_bias else None
        order = list(gm.graph.nodes)
        first = min((w.node for w in members), key=order.index)
        name = _merged_name(members)
        grad = members[0].weight.requires_grad
        if all(w.node.op == "call_module" for w in members):
            lin = nn.Linear(weight.shape[1], weight.shape[0], bias=with_bias,
                            dtype=weight.dtype, device=weight.device)
            lin.weight = nn.Parameter(weight, requires_grad=grad)
            if with_bias:
                lin.bias = nn.Parameter(bias, requires_grad=grad)
            target = fresh_path(gm, name)
            gm.add_submodule(target, lin)
            with gm.graph.inserting_before(first):
                wide = gm.graph.call_module(target, (x,))
        else:
            wn = new_const(gm, first, f"{name}.weight", weight)
            args = (x, wn, new_const(gm, first, f"{name}.bias", bias)) if with_bias else (x, wn)
            fn = aten.linear.default if any(is_aten(w.node) for w in members) else F.linear
            with gm.graph.inserting_before(first):
                wide = gm.graph.call_function(fn, args)
        self._slice(gm, wide, members, weight.shape[0])
        drop_dead_attrs(gm, erase(gm, [w.node for w in members]))

    def _slice(self, gm, wide: fx.Node, members: list[Weighted], total: int) -> None:
        aten_graph = any(is_aten(w.node) for w in members)
        narrow = aten.narrow.default if aten_graph else torch.narrow
        offset, cursor = 0, wide
        for w in members:
            n = w.weight.shape[0]
            with gm.graph.inserting_after(cursor):
                piece = gm.graph.call_function(narrow, (wide, -1, offset, n))
            cursor = piece
            copy_meta(piece, w.node)
            w.node.replace_all_uses_with(piece)
            shapes = shapes_seen(piece)
            for user in list(piece.users):
                if raw_name(user) not in ("view", "_unsafe_view"):
                    continue
                outs = shapes_seen(user)
                if shapes and len(shapes) == len(outs) and all(
                        _viewable(sh, total, o) for sh, o in zip(shapes, outs, strict=True)):
                    continue  # a view of the slice works at the example and every probe
                with gm.graph.inserting_before(user):
                    if aten_graph:
                        c = gm.graph.call_function(aten.clone.default, (piece,),
                                                   {"memory_format": torch.contiguous_format})
                    else:
                        c = gm.graph.call_method("contiguous", (piece,))
                user.replace_input_with(piece, c)
            offset += n

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        nodes = [node_by_name(gm, n) for n in site.data["members"]]
        x = node_by_name(gm, site.data["input"])
        x_bytes = info(x).nbytes if x is not None and info(x) else 0
        gone = [node_cost(n) for n in nodes]
        # same FLOPs, same weights and outputs; x is read once instead of k times
        wide = NodeCost(sum(c.flops for c in gone),
                        sum(c.bytes for c in gone) - (len(nodes) - 1) * x_bytes)
        return saving(target, nodes, [wide], f"{len(nodes)} GEMMs -> 1: {x.name if x else 'x'} "
                      f"read once instead of {len(nodes)} times")
