"""fusion.parallel_conv: convolutions reading one tensor -> one convolution.

Two forms, both exact (the same sums in the same order per output channel):

- **Concatenated.** k convs read the same input x with the same kernel size, stride,
  padding, dilation and groups (an Inception block's 1x1 branches): one conv with the
  out-channels stacked reads x once and runs one larger kernel; each reader gets its
  channel range back as a view (one split). With groups > 1 a group's rows of every
  member are placed together, so the wide output is [N, g, sum(Co_i/g), ...] and each
  member's channels are gathered by one copy: that costs a write, which `predict` counts.
- **Grouped.** k convs each read one channel slice of x, cut by a split or chunk along
  the channels (ResNeXt's and Inception's branch splits): when the slices are equal and
  the convs agree in settings and out-channels, they are one grouped conv with k times
  the groups, on x itself; the split goes, and each reader gets a view again.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, copy_meta, is_aten, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import call, drop_dead_attrs, erase, fresh_path, new_const
from opswap.rules._matching import input_of
from opswap.rules._weights import Weighted, weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.fusion.parallel_linear import _in_graph_order, _merged_name
from opswap.rules.registry import register

aten = torch.ops.aten

_MODULES: dict[int, type[nn.Module]] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_FUNCS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _settings(w: Weighted) -> tuple[Any, ...]:
    """What two convs must share to be one: rank, kernel and in-channels per group,
    stride, padding, dilation, groups, padding mode, dtype and device."""
    return (
        w.weight.dim() - 2,
        tuple(w.weight.shape[1:]),
        tuple(w.stride),
        w.padding if isinstance(w.padding, str) else tuple(w.padding),
        tuple(w.dilation),
        w.groups,
        w.padding_mode,
        w.weight.dtype,
        w.weight.device,
    )


def _describe(w: Weighted) -> str:
    k = "x".join(str(s) for s in w.weight.shape[2:])
    pad = w.padding if isinstance(w.padding, str) else tuple(w.padding)
    return (
        f"kernel {k}, {w.weight.shape[1] * w.groups} in-channels, stride {tuple(w.stride)}, "
        f"padding {pad}, dilation {tuple(w.dilation)}, groups {w.groups}, "
        f"{str(w.weight.dtype).removeprefix('torch.')} on {w.weight.device}"
        + ("" if w.padding_mode == "zeros" else f", padding_mode {w.padding_mode}")
    )


def _read(gm: fx.GraphModule, n: fx.Node, x: fx.Node) -> Weighted | str:
    """The conv's weights, or why it cannot merge with the others reading x."""
    w = weighted(gm, n)
    if isinstance(w, str):
        return f"{w}, so it cannot merge with the other convolutions reading {x.name}"
    if w.transposed:
        return f"{n.name} is a transposed convolution, which this rule does not merge"
    return w


def _split_of(x: fx.Node) -> tuple[fx.Node, int] | None:
    """(split node, piece index) when x is one piece of a split/chunk along dim 1."""
    if x.op != "call_function" or x.target is not operator.getitem:
        return None
    src = x.args[0]
    if not isinstance(src, fx.Node) or op_kind(src) != "split" or raw_name(src) == "unbind":
        return None
    dim = arg(src, 2, "dim", 0)
    xi = info(src.args[0]) if isinstance(src.args[0], fx.Node) else None
    if not isinstance(dim, int) or xi is None or dim not in (1, 1 - len(xi.shape)):
        return None
    return src, int(x.args[1])  # type: ignore[arg-type]


def _bias(members: list[Weighted]) -> list[torch.Tensor] | None:
    """Each member's bias, a zero one for the bias-free (x + 0 is exact); None when no
    member has one."""
    if all(w.bias is None for w in members):
        return None
    return [
        w.bias.detach()
        if w.bias is not None
        else torch.zeros(w.weight.shape[0], dtype=w.weight.dtype, device=w.weight.device)
        for w in members
    ]


@register
class ParallelConv(Rule):
    """Convolutions reading one tensor -> one convolution, then views (see the module
    docstring for the concatenated and the grouped form). Transposed convs, convs with
    non-constant weights and convs whose settings differ stay apart, with the reason."""

    name = "fusion.parallel_conv"
    family = "fusion"
    chapter = 5
    exactness = "exact"
    relieves = ("compute:conv", "memory:conv")
    description = (
        "Convolutions with the same settings reading one input (Inception branches) -> one "
        "conv with stacked out-channels, and convs on equal channel slices of one tensor "
        "(ResNeXt branches) -> one grouped conv: one kernel and one read of the input."
    )
    # convs whose BatchNorm conv_bn folds can merge; after merging, a BatchNorm would
    # follow a slice, which conv_bn cannot fold. The int8 conv rule takes its convs one by
    # one first (its hand-off between int8 convs follows their readers), and convs it made
    # int8 stay apart
    after = ("fusion.conv_bn", "precision.int8_static_conv")
    before = ("fusion.conv_relu",)
    anchors = ("conv",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> list[Found | Refused] | None:
        x = input_of(node)
        if x is None:
            return None
        split = _split_of(x)
        if split is not None:
            grouped = self._grouped(gm, node, x, split[0])
            if grouped is not None:
                return grouped
        return self._concatenated(gm, node, x)

    # ------------------------------------------------------------------ concatenated form

    def _concatenated(
        self, gm: fx.GraphModule, node: fx.Node, x: fx.Node
    ) -> list[Found | Refused] | None:
        convs = [u for u in x.users if op_kind(u) in ("conv", "conv_transpose")]
        nodes = _in_graph_order(x, [u for u in convs if input_of(u) is x])
        if len(nodes) < 2 or nodes[0] is not node:
            return None
        out: list[Found | Refused] = []
        ok: list[Weighted] = []
        for n in nodes:
            w = _read(gm, n, x)
            if isinstance(w, str):
                out.append(Refused(w, n))
            else:
                ok.append(w)
        by_kind: dict[tuple[Any, ...], list[Weighted]] = defaultdict(list)
        for w in ok:
            by_kind[_settings(w)].append(w)
        members = max(by_kind.values(), key=len, default=[])
        if len(members) < 2:
            members = []
        for w in ok:
            if w not in members and (members or len(by_kind) > 1):
                ref = members[0] if members else next(v for v in ok if v is not w)
                out.append(
                    Refused(
                        f"{w.node.name} has {_describe(w)} while {ref.node.name} has "
                        f"{_describe(ref)}; convolutions of one input merge only with the "
                        "same settings",
                        w.node,
                    )
                )
        if not members:
            return out
        names = [w.node.name for w in members]
        desc = f"merge {', '.join(names)} (all reading {x.name}) into one conv"
        if members[0].groups > 1:
            desc += f" of {members[0].groups} groups, each member's channels gathered after it"
        member_nodes = tuple(w.node for w in members)
        out.append(
            Found(
                member_nodes,
                desc,
                dict(x=x, members=members, form="concat"),
                outputs=member_nodes,
                record=dict(input=x.name, members=names, form="concat"),
            )
        )
        return out

    # ------------------------------------------------------------------ grouped form

    def _grouped(
        self, gm: fx.GraphModule, node: fx.Node, x: fx.Node, split: fx.Node
    ) -> list[Found | Refused] | None:
        """At the first conv reading a piece of `split`: one grouped conv, or a reason;
        None when the pieces are not each read by one conv alone (left to the other form)."""
        pieces = list(split.users)
        if any(p.op != "call_function" or p.target is not operator.getitem for p in pieces):
            return None
        if any(len(p.users) != 1 or op_kind(next(iter(p.users))) != "conv" for p in pieces):
            return None
        pieces.sort(key=lambda p: p.args[1] if isinstance(p.args[1], int) else -1)
        convs = [next(iter(p.users)) for p in pieces]
        if any(input_of(c) is not p for c, p in zip(convs, pieces, strict=True)):
            return None
        order = _in_graph_order(split, convs)
        if len(convs) < 2 or order[0] is not node:
            return None
        src = split.args[0]
        assert isinstance(src, fx.Node)
        si = info(src)
        total = int(si.shape[1]) if si is not None else 0
        members: list[Weighted] = []
        for c in convs:
            w = _read(gm, c, src)
            if isinstance(w, str):
                return [Refused(w, c)]
            members.append(w)
        first = members[0]
        for w in members[1:]:
            if _settings(w) != _settings(first) or w.weight.shape[0] != first.weight.shape[0]:
                return [
                    Refused(
                        f"{w.node.name} has {_describe(w)} and {w.weight.shape[0]} out-channels "
                        f"while {first.node.name} has {_describe(first)} and "
                        f"{first.weight.shape[0]}; the branches of {split.name} become one "
                        "grouped conv only when they agree",
                        w.node,
                    )
                ]
        cin = first.weight.shape[1] * first.groups
        if cin * len(members) != total:
            return [
                Refused(
                    f"{split.name} cuts {src.name}'s {total} channels into pieces that are not "
                    f"all {cin} wide, so its branches are not one grouped conv",
                    node,
                )
            ]
        names = [w.node.name for w in members]
        groups = first.groups * len(members)
        return [
            Found(
                (split, *pieces, *convs),
                f"merge {', '.join(names)} (on the {len(members)} channel slices of {src.name} "
                f"cut by {split.name}) into one conv of {groups} groups",
                dict(x=src, members=members, form="grouped"),
                outputs=tuple(convs),
                record=dict(input=src.name, members=names, form="grouped", groups=groups),
            )
        ]

    # ------------------------------------------------------------------ rewrite

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        x, members, form = found["x"], found["members"], found["form"]
        first = members[0]
        g = first.groups
        ws = [w.weight.detach() for w in members]
        bs = _bias(members)
        if form == "concat" and g > 1:
            # rows of group j of every member together: [g, sum(Co_i/g), Cin/g, *k]
            weight = torch.cat([w.unflatten(0, (g, -1)) for w in ws], 1).flatten(0, 1)
            bias = None if bs is None else torch.cat([b.view(g, -1) for b in bs], 1).flatten()
        else:
            weight = torch.cat(ws, 0)
            bias = None if bs is None else torch.cat(bs)
        groups = g * len(members) if form == "grouped" else g
        order = list(gm.graph.nodes)
        at = min((w.node for w in members), key=order.index)
        name = _merged_name(members)
        dim = weight.dim() - 2
        aten_graph = any(is_aten(w.node) for w in members)
        if all(w.node.op == "call_module" for w in members):
            conv = _MODULES[dim](
                weight.shape[1] * groups,
                weight.shape[0],
                tuple(weight.shape[2:]),
                stride=first.stride,
                padding=first.padding,
                dilation=first.dilation,
                groups=groups,
                bias=bias is not None,
                padding_mode=first.padding_mode,
                dtype=weight.dtype,
                device=weight.device,
            )
            grad = first.weight.requires_grad
            conv.weight = nn.Parameter(weight, requires_grad=grad)
            if bias is not None:
                conv.bias = nn.Parameter(bias, requires_grad=grad)
            target = fresh_path(gm, name)
            gm.add_submodule(target, conv)
            with gm.graph.inserting_before(at):
                wide = gm.graph.call_module(target, (x,))
        else:
            wn = new_const(gm, at, f"{name}.weight", weight)
            bn = new_const(gm, at, f"{name}.bias", bias) if bias is not None else None
            pad = first.padding if isinstance(first.padding, str) else list(first.padding)
            settings = (list(first.stride), pad, list(first.dilation), groups)
            if aten_graph:
                packet = getattr(aten, f"conv{dim}d")
                fn = packet.padding if isinstance(pad, str) else packet.default
            else:
                fn = _FUNCS[dim]
            with gm.graph.inserting_before(at):
                wide = gm.graph.call_function(fn, (x, wn, bn, *settings))
        if form == "concat" and g > 1:
            self._gather(gm, wide, members, g)
        else:
            self._slice(gm, wide, members, aten_graph)
        removed = [w.node for w in members]
        if form == "grouped":
            removed += list(found.nodes[: -len(members)])
        drop_dead_attrs(gm, erase(gm, removed))

    def _slice(self, gm: fx.GraphModule, wide: fx.Node, members: list[Weighted], at: bool) -> None:
        split = aten.split_with_sizes.default if at else torch.split
        sizes = [int(w.weight.shape[0]) for w in members]
        with gm.graph.inserting_after(wide):
            parts = gm.graph.call_function(split, (wide, sizes, 1))
        cursor = parts
        for i, w in enumerate(members):
            with gm.graph.inserting_after(cursor):
                piece = gm.graph.call_function(operator.getitem, (parts, i))
            cursor = piece
            copy_meta(piece, w.node)
            w.node.replace_all_uses_with(piece)

    def _gather(self, gm: fx.GraphModule, wide: fx.Node, members: list[Weighted], g: int) -> None:
        """Grouped members: the wide output is [N, g, sum(Co_i/g), ...]; member i's
        channels are one slice along dim 2, flattened back to [N, Co_i, ...] (a copy)."""
        like = members[0].node
        per = [int(w.weight.shape[0]) // g for w in members]
        with gm.graph.inserting_after(wide):
            grid = call(gm.graph, like, "unflatten.int", (wide, 1, [g, sum(per)]))
        with gm.graph.inserting_after(grid):
            parts = call(gm.graph, like, "split_with_sizes", (grid, per, 2))
        cursor = parts
        for i, w in enumerate(members):
            with gm.graph.inserting_after(cursor):
                piece = gm.graph.call_function(operator.getitem, (parts, i))
            with gm.graph.inserting_after(piece):
                flat = call(gm.graph, like, "flatten.using_ints", (piece, 1, 2))
            cursor = flat
            copy_meta(flat, w.node)
            w.node.replace_all_uses_with(flat)

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        members = found["members"]
        nodes = [w.node for w in members]
        x_info = info(found["x"])
        x_bytes = x_info.nbytes if x_info else 0
        gone = [node_cost(n) for n in nodes]
        flops = sum(c.flops for c in gone)
        nbytes = sum(c.bytes for c in gone)
        removed = list(nodes)
        added: list[NodeCost] = []
        if found["form"] == "grouped":
            removed += [n for n in found.nodes if n not in nodes]
            added.append(NodeCost(flops, nbytes))
            note = f"{len(nodes)} convs on slices -> 1 grouped conv: one kernel"
        else:
            added.append(NodeCost(flops, nbytes - (len(nodes) - 1) * x_bytes))
            note = f"{len(nodes)} convs -> 1: {found['x'].name} read once instead of {len(nodes)}"
            if members[0].groups > 1:
                added += [NodeCost(0, 2 * i.nbytes) for i in map(info, nodes) if i is not None]
                note += ", plus a copy of each output to gather its groups"
        return saving(target, removed, added, note)
