"""layout.permute_matmul: no transpose per call for a matmul with a constant or strided operand."""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from opswap.graph.ops import arg, attr_tensor, copy_meta, fresh_attr_name, raw_name, set_attr_tensor
from opswap.graph.shapes import info
from opswap.rules._cost import bytes_estimate, moved_bytes
from opswap.rules._edits import call, drop_dead_attrs, erase
from opswap.rules._matching import matmul_reads_in_place, perm_of, strides
from opswap.rules.base import Estimate, Found, Refused, Verdict
from opswap.rules.layout._base import TRANSPOSE_KINDS, LayoutRule, fewer
from opswap.rules.registry import register
from opswap.targets.base import Target

MATMULS = {"matmul", "mm", "bmm", "__matmul__"}


def is_matmul(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and raw_name(node) in MATMULS


def constant_transpose_check(gm: fx.GraphModule, node: fx.Node, perm: list[int]) -> Verdict:
    """A transpose of a constant read by a matmul: as linear(x, W), or stored permuted."""
    mms = [u for u in node.users if is_matmul(u)]
    if not mms:
        return None
    w_node = cast(fx.Node, node.args[0])  # perm_of found a node there
    w = attr_tensor(gm, w_node)
    if w is None:
        return Refused(f"{w_node.name} is not a tensor constant")
    mm = mms[0]
    if (
        len(node.users) == 1
        and w.dim() == 2
        and perm == [1, 0]
        and raw_name(mm) in ("matmul", "__matmul__", "mm")
        and len(mm.args) == 2
        and not mm.kwargs
        and mm.args[1] is node
        and mm.args[0] is not node
    ):
        return Found(
            (node, mm),
            f"{mm.name}: x @ {w_node.name}^T as linear(x, {w_node.name})",
            {"mode": "linear"},
            key=f"linear:{mm.name}",
            record={"mode": "linear"},
        )
    record = {"mode": "pretranspose", "perm": perm}
    return Found(
        (node,),
        f"{node.name}: store {w_node.name} permuted by {tuple(perm)} once",
        dict(record),
        key=f"pretranspose:{node.name}",
        record=record,
    )


def strided_operand_check(node: fx.Node, src: fx.Node) -> Verdict:
    """`transpose -> contiguous -> matmul`: can matmul read the transpose directly?"""
    fmt = arg(node, 1, "memory_format", torch.contiguous_format)
    users = list(node.users)
    if fmt not in (torch.contiguous_format, torch.preserve_format) or not any(
        is_matmul(u) for u in users
    ):
        return None
    if not all(is_matmul(u) for u in users):
        others = ", ".join(u.name for u in users if not is_matmul(u))
        return Refused(
            f"{node.name}'s output is also read by {others}, which may need contiguous memory"
        )
    i, st = info(src), strides(src)
    if i is None or st is None:
        return Refused(f"the strides of {src.name} are not known")
    if not matmul_reads_in_place(i.shape, st):
        return Refused(
            f"torch.matmul would copy {src.name} itself (strides {st} are not "
            "a batch of row- or column-major matrices whose batch dims fold into "
            "one), so dropping the contiguous saves nothing"
        )
    for mm in users:
        for other in mm.args[:2]:
            o = info(other) if other is not node else None
            if o is not None and (
                len(o.shape) > len(i.shape) or (len(o.shape) > 2 and o.shape[:-2] != i.shape[:-2])
            ):
                return Refused(
                    f"{mm.name} broadcasts {src.name} over other batch dims, "
                    "which makes torch.matmul copy it"
                )
    return Found(
        (node,),
        f"{node.name}: {users[0].name} reads {src.name} strided, without the copy",
        {"mode": "contiguous"},
        key=f"contiguous:{node.name}",
        record={"mode": "contiguous"},
    )


@register
class PermuteMatmul(LayoutRule):
    name = "layout.permute_matmul"
    relieves = ("memory:data-movement",)
    description = (
        "A transposed constant feeding a matmul (x @ W.t()) becomes linear(x, W), or the "
        "constant is stored pre-transposed, so no transpose runs per call and a batched "
        "matmul no longer copies a strided weight. A .contiguous() between a transpose and "
        "a matmul that can read the strided operand directly is dropped: BLAS reads a "
        "column-major matrix through its transpose flag, so the operand's copy no longer "
        "goes through memory (2x its bytes saved per call)."
    )
    # a chain of transposes of a constant is composed first, so one transpose is seen here
    after = ("layout.cancel_transpose",)

    anchors = (*TRANSPOSE_KINDS, "contiguous")

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Verdict:
        perm = perm_of(node)
        if perm is not None and cast(fx.Node, node.args[0]).op == "get_attr":
            return constant_transpose_check(gm, node, perm)
        if (
            raw_name(node) == "contiguous"
            and node.op != "call_module"
            and node.args
            and isinstance(node.args[0], fx.Node)
            and perm_of(node.args[0]) is not None
        ):
            return strided_operand_check(node, node.args[0])
        return None

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        nodes = found.nodes
        mode = found["mode"]
        if mode == "contiguous":
            nodes[0].replace_all_uses_with(cast(fx.Node, nodes[0].args[0]))
            erase(gm, nodes)
            return
        tr = nodes[0]
        w_node = cast(fx.Node, tr.args[0])  # check: a transpose of a get_attr
        if mode == "linear":
            mm = nodes[1]
            with gm.graph.inserting_after(mm):
                new = call(gm.graph, mm, "linear", (mm.args[0], w_node))
            copy_meta(new, mm)
            mm.replace_all_uses_with(new)
            erase(gm, nodes)
            return
        w = cast(torch.Tensor, attr_tensor(gm, w_node))
        stored = w.detach().permute(found["perm"]).contiguous()
        attr = fresh_attr_name(gm, f"{w_node.target}_permuted")
        set_attr_tensor(gm, attr, stored, as_param=isinstance(w, nn.Parameter))
        with gm.graph.inserting_before(tr):
            new = gm.graph.get_attr(attr)
        new.meta["tensor_meta"] = _extract_tensor_metadata(stored)
        tr.replace_all_uses_with(new)
        erase(gm, [tr])
        drop_dead_attrs(gm, [w_node])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        nodes = found.nodes
        mode = found["mode"]
        if mode == "contiguous":
            return bytes_estimate(
                moved_bytes(nodes),
                target,
                "the operand's copy is no longer "
                "written and read back; BLAS reads it through its transpose "
                "flag",
                kernels_saved=1,
            )
        if mode == "linear":
            return bytes_estimate(
                0,
                target,
                "BLAS already read W^T in place, so no data moves; "
                f"{fewer(1)} (transpose and matmul become one linear)",
                views_saved=1,
            )
        tr = nodes[0]
        i, st = info(tr), strides(tr)
        copied = i is not None and st is not None and not matmul_reads_in_place(i.shape, st)
        note = (
            "matmul copied the strided constant every call"
            if copied
            else "no data moved per call before either"
        )
        w_node = cast(fx.Node, tr.args[0])
        if len(w_node.users) > 1:
            note += f"; {w_node.name} is also read elsewhere, so both layouts are stored"
        moved = 2 * i.nbytes if copied and i is not None else 0
        return bytes_estimate(
            moved,
            target,
            f"{note}; {fewer(1)}",
            kernels_saved=1 if copied else 0,
            views_saved=0 if copied else 1,
        )
