"""layout.drop_identity: ops that return their input, and copies nobody needs, are removed."""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.ops import arg, module_of, op_kind, raw_name
from opswap.graph.purity import first_write
from opswap.graph.shapes import info, strides_seen
from opswap.rules._cost import bytes_estimate, moved_bytes
from opswap.rules._edits import erase
from opswap.rules._matching import aliases_reach_output, has_layout, storage_root, strides
from opswap.rules.base import Estimate, Found, Refused, Verdict
from opswap.rules.layout._base import LayoutRule, fewer
from opswap.rules.registry import register
from opswap.targets.base import Target

_CASTS = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _same_dtype_cast(node: fx.Node) -> bool:
    """`.to(dtype)` / `.float()` ... to the dtype the tensor already has, without copy=True:
    torch returns the input itself."""
    name = raw_name(node)
    src, out = info(node.args[0]), info(node)
    if src is None or out is None or src.dtype != out.dtype:
        return False
    if name in _CASTS:
        return len(node.args) == 1 and not node.kwargs and _CASTS[name] == src.dtype
    if name != "to":
        return False
    rest = list(node.args[1:])
    dtype = rest.pop(0) if rest and isinstance(rest[0], torch.dtype) else node.kwargs.get("dtype")
    if len(rest) > 2 or not all(isinstance(v, bool) for v in rest):
        return False  # a device, a tensor to match, or flags we do not read
    flags = dict(zip(("non_blocking", "copy"), rest, strict=False))
    flags.update((k, v) for k, v in node.kwargs.items() if k != "dtype")
    fmt = flags.pop("memory_format", None)
    flags.pop("non_blocking", None)
    copy = flags.pop("copy", False)
    return dtype == src.dtype and not copy and not flags and fmt in (None, torch.preserve_format)


def identity_check(gm: fx.GraphModule, node: fx.Node) -> Verdict:
    """Whether `node` returns its input (or a copy nobody needs) and can go."""
    if node.op == "call_module":
        return (
            Found((node,), f"{node.name} is an nn.Identity")
            if isinstance(module_of(node), nn.Identity)
            else None
        )
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    src, name = node.args[0], raw_name(node)
    if not isinstance(src, fx.Node):
        return None
    if name == "alias":
        return Found((node,), f"{node.name} is an alias of {src.name}")
    if op_kind(node) == "to" and name != "_to_copy":
        if not _same_dtype_cast(node):
            return None
        return Found((node,), f"{node.name} casts to the dtype {src.name} already has")
    if name not in ("contiguous", "clone", "_to_copy"):
        return None
    if name == "_to_copy" and (
        set(node.kwargs) - {"dtype", "memory_format", "non_blocking"} or len(node.args) > 1
    ):
        return None  # a device or layout change
    i, s_in, s_out = info(src), strides(src), strides(node)
    if i is None or s_in is None or s_out is None:
        return Refused(
            f"the strides of {src.name} are not known, so {node.name} cannot be shown to be a no-op"
        )
    root = storage_root(src)
    if name == "contiguous":
        fmt = arg(node, 1, "memory_format", torch.contiguous_format)
        if not has_layout(i.shape, s_in, fmt):
            return None  # a real copy, doing its job: not a near miss
        other = next(
            ((sh, st) for sh, st in strides_seen(src)[1:] if not has_layout(sh, st, fmt)), None
        )
        if other is not None:
            return Refused(
                f"{src.name} is contiguous at the example's shape but not at "
                f"{list(other[0])} (strides {list(other[1])}), so {node.name} is a "
                "real copy there"
            )
        if root.op == "placeholder":
            return Refused(
                f"{node.name} lays out the model input {root.name}, which "
                "callers may pass with any strides"
            )
        return Found((node,), f"{src.name} is already contiguous")
    # clone / _to_copy: a fresh copy. Dropping it only changes who shares memory.
    if (out := info(node)) is None or out.dtype != i.dtype:
        return None
    if s_in != s_out or [st for _, st in strides_seen(src)] != [st for _, st in strides_seen(node)]:
        return None  # a copy that changes the layout is a real op: not a near miss
    writer = first_write(gm)
    if writer is not None:
        return Refused(
            f"the graph writes into tensors in place ({writer.name}), so "
            f"{node.name}'s copy may be protecting {src.name}"
        )
    if aliases_reach_output(node) and (
        root.op in ("placeholder", "get_attr") or aliases_reach_output(root, skip=node)
    ):
        return Refused(f"without {node.name} the output would share memory with {root.name}")
    return Found((node,), f"nothing writes into {src.name} or its copy {node.name}")


@register
class DropIdentity(LayoutRule):
    name = "layout.drop_identity"
    training = True
    phase = "early"  # a clean-up the other rules match better after
    relieves = ("memory:data-movement",)
    description = (
        "Ops that return their input (nn.Identity, aten.alias, .contiguous() of a contiguous "
        "tensor, .to() the dtype it has) and copies nobody needs (a clone with the same "
        "strides, in a graph that writes nothing in place) are removed. A removed clone "
        "saves writing and re-reading its tensor; the others save a dispatch."
    )
    anchors = ("identity", "to", "contiguous")

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Verdict:
        return identity_check(gm, node)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        (node,) = found.nodes
        node.replace_all_uses_with(cast(fx.Node, node.args[0]))
        erase(gm, [node])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        (node,) = found.nodes
        if raw_name(node) in ("clone", "_to_copy"):
            return bytes_estimate(
                moved_bytes([node]),
                target,
                f"a copy no longer written and read back; {fewer(1)}",
                kernels_saved=1,
            )
        return bytes_estimate(
            0, target, f"it returned its input: no data moves; {fewer(1)}", views_saved=1
        )
