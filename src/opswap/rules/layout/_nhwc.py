"""Channels-last (NHWC) conversion of a whole graph, for `layout.channels_last`.

A 2-D convolution given NCHW activations on a backend whose fast kernels are NHWC
(oneDNN on CPU, cuDNN tensor-core kernels on GPU) reorders its input into NHWC (or a
blocked layout) and its output back, every call. Converting once at the model's
inputs, storing conv weights channels-last, and converting back at the outputs moves
those reorders out of the loop: convolutions then produce channels-last outputs,
which BatchNorm, activations, pooling and additions preserve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import Argument
from torch.fx.passes.shape_prop import TensorMetadata

from opswap.errors import RuleError
from opswap.graph.ops import attr_tensor, module_of, op_kind, raw_name, set_attr_tensor
from opswap.graph.shapes import info
from opswap.rules._edits import call

CL = torch.channels_last


@dataclass
class NhwcPlan:
    """What converting one graph involves."""

    convs: list[fx.Node] = field(default_factory=list)
    entries: list[fx.Node] = field(default_factory=list)  # activations converted to NHWC
    outputs: list[fx.Node] = field(default_factory=list)  # results converted back to contiguous
    views: list[fx.Node] = field(default_factory=list)  # .view() inputs converted back

    def names(self) -> dict[str, list[str]]:
        """The plan by node name, as a saved plan records it."""
        return {
            "convs": [n.name for n in self.convs],
            "entries": [n.name for n in self.entries],
            "outputs": [n.name for n in self.outputs],
            "views": [n.name for n in self.views],
        }


def is_conv4d(node: fx.Node) -> bool:
    if op_kind(node) not in ("conv", "conv_transpose"):
        return False
    out, src = info(node), info(node.args[0]) if node.args else None
    return out is not None and src is not None and len(out.shape) == 4 and len(src.shape) == 4


def _downstream(starts: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(starts)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _output_leaves(gm: fx.GraphModule) -> list[fx.Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves: list[fx.Node] = []
    fx.node.map_arg(out.args, lambda n: leaves.append(n))
    return leaves


def plan_nhwc(gm: fx.GraphModule) -> NhwcPlan:
    """Find the convs to convert and where the layout must change."""
    plan = NhwcPlan(convs=[n for n in gm.graph.nodes if is_conv4d(n)])
    if not plan.convs:
        return plan
    after = _downstream(plan.convs)  # values computed from a conv output: NHWC once converted
    for c in plan.convs:
        src = cast(fx.Node, c.args[0])  # is_conv4d read its shape
        if src not in after and src not in plan.entries:
            plan.entries.append(src)
    for leaf in _output_leaves(gm):
        i = info(leaf)
        # every tensor output, not only 4-D ones: conv(x).flatten(2) of a channels-last
        # tensor has other strides too, and a caller's .view() of it would raise
        if leaf in after and i is not None and len(i.shape) >= 2 and leaf not in plan.outputs:
            plan.outputs.append(leaf)
    for n in after:
        if raw_name(n) == "view" and n.args and n.args[0] in after:
            i = info(n.args[0])
            if i is not None and len(i.shape) == 4:
                plan.views.append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    plan.views.sort(key=order.__getitem__)
    return plan


def nhwc_strides(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether torch reads these 4-D strides as channels-last (its own test, which settles
    ambiguous size-1 cases as NCHW): C innermost, then W, then H, then N."""
    if len(shape) != 4 or stride[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if stride[d] == 0 or stride[d] < low or (d == 0 and low == stride[1]):
            return False
        low = stride[d] * (shape[d] if shape[d] > 1 else 1)
    return True


def already_nhwc(plan: NhwcPlan) -> bool:
    """True when every conv already produces channels-last output."""
    for conv in plan.convs:
        meta = conv.meta.get("tensor_meta")
        if not isinstance(meta, TensorMetadata) or not nhwc_strides(meta.shape, meta.stride):
            return False
    return True


def _restrided(w: torch.Tensor) -> torch.Tensor:
    # clone, not .contiguous(memory_format=...): with one input channel the NCHW strides
    # already pass as channels-last, and contiguous() would keep them, so the conv would
    # still pick NCHW. clone writes the channels-last strides out explicitly.
    return w.detach().clone(memory_format=CL)


def _to_channels_last(gm: fx.GraphModule, conv: fx.Node) -> None:
    if conv.op == "call_module":
        mod = cast(nn.Module, module_of(conv))
        weight = cast(torch.Tensor, mod.weight)
        mod.weight = nn.Parameter(_restrided(weight), requires_grad=weight.requires_grad)
        return
    w_node = conv.args[1] if len(conv.args) > 1 else conv.kwargs.get("weight")
    w = attr_tensor(gm, w_node) if isinstance(w_node, fx.Node) else None
    if w is None or w.dim() != 4:
        return  # a weight computed at run time: the conv adapts it itself
    target = str(cast(fx.Node, w_node).target)  # w was read from this node
    set_attr_tensor(gm, target, _restrided(w), as_param=isinstance(w, nn.Parameter))


def _convert(
    gm: fx.GraphModule, node: fx.Node, readers: list[fx.Node], fmt: torch.memory_format
) -> None:
    """Insert a copy of `node` in memory format `fmt` and make `readers` read it."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(readers, key=order.__getitem__)
    like = first if first.op != "output" else node
    with gm.graph.inserting_before(first):
        i = info(node)
        if fmt is CL and i is not None and (i.shape[1] == 1 or i.shape[2] * i.shape[3] == 1):
            # NCHW strides of such a tensor already pass as channels-last, so contiguous()
            # would keep them; clone writes channels-last strides out explicitly
            new = call(gm.graph, like, "clone", (node,), {"memory_format": CL})
        elif fmt is CL:
            new = call(gm.graph, like, "contiguous", (node,), {"memory_format": CL})
        else:
            new = call(gm.graph, like, "contiguous", (node,))
    for r in readers:
        r.replace_input_with(node, new)


def rewrite_nhwc(gm: fx.GraphModule, plan: NhwcPlan) -> None:
    for c in plan.convs:
        _to_channels_last(gm, c)
    conv_set = set(plan.convs)
    for node in plan.entries:
        _convert(gm, node, [u for u in node.users if u in conv_set], CL)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for o in plan.outputs:
        _convert(gm, o, [out], torch.contiguous_format)
    for view in plan.views:
        _convert(gm, cast(fx.Node, view.args[0]), [view], torch.contiguous_format)


def check_runs(gm: fx.GraphModule) -> None:
    """Run the graph on fake tensors shaped like its inputs, so that a stride-sensitive op
    the conversion broke is reported now (and the rewrite rolled back), not at run time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    metas = [n.meta.get("tensor_meta") for n in gm.graph.nodes if n.op == "placeholder"]
    if not all(isinstance(m, TensorMetadata) for m in metas):
        return  # a non-tensor input: nothing to build fakes from
    gm.recompile()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype) for m in metas]
            fx.Interpreter(gm).run(*args)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuleError(
            f"after converting to channels_last the model no longer runs ({first[:160]}); "
            "an op there needs NCHW strides"
        ) from e


def traffic(plan: NhwcPlan) -> tuple[int, int]:
    """(bytes the convs stop reordering, bytes the added conversions move)."""

    def nbytes(node: Argument) -> int:
        i = info(node)
        return i.nbytes if i is not None else 0

    saved = sum(2 * (nbytes(c.args[0]) + nbytes(c)) for c in plan.convs)
    paid = sum(2 * nbytes(n) for n in plan.entries + plan.outputs)
    paid += sum(2 * nbytes(v.args[0]) for v in plan.views)
    return saved, paid
