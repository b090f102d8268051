"""layout.collapse_view: a chain of reshapes becomes one reshape, or nothing.

Chains of layout ops, and the one shape a chain of reshapes amounts to.

view, reshape, flatten, unflatten, squeeze and unsqueeze all keep a tensor's elements
in row-major order; only the sizes change. A chain of them is therefore
`reshape(input, final_shape)`: the question is only whether `final_shape` can be
written down in the graph. It can when the last op spells it out (its literal sizes,
or size values the graph already computes, are reused as they are), or when every size
along the chain is fixed at capture; not when a squeeze/flatten at the end derives it
from a size that is only known at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.fx as fx

from opswap.graph.ops import raw_name
from opswap.graph.shapes import dynamic_dims, info, same_everywhere, shapes_seen
from opswap.rules._cost import bytes_estimate
from opswap.rules._edits import shape_args
from opswap.rules.base import Estimate, Found, Refused, Verdict
from opswap.rules.layout._base import LayoutRule, chain_check, chain_found, fewer, replace_chain
from opswap.rules.registry import register
from opswap.targets.base import Target

_SHAPE_NAMES = {
    "view",
    "_unsafe_view",
    "reshape",
    "flatten",
    "squeeze",
    "unsqueeze",
    "unflatten",
    "Flatten",
    "Unflatten",
}


def is_shape_op(node: fx.Node) -> bool:
    """A reshape-like op on a tensor whose shapes are known (not a dtype-reinterpreting view)."""
    if node.op not in ("call_function", "call_method", "call_module") or not node.args:
        return False
    if not isinstance(node.args[0], fx.Node) or raw_name(node) not in _SHAPE_NAMES:
        return False
    if any(isinstance(a, torch.dtype) for a in node.args[1:]) or "dtype" in node.kwargs:
        return False
    out, src = info(node), info(node.args[0])
    return out is not None and src is not None and out.dtype == src.dtype


def _spelled_shape(node: fx.Node) -> list | None:
    """The sizes a view/reshape spells out (ints, -1, or size nodes), else None."""
    if raw_name(node) not in ("view", "_unsafe_view", "reshape"):
        return None
    rest = list(node.args[1:]) or [node.kwargs.get("shape", node.kwargs.get("size"))]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        rest = list(rest[0])
    elif len(rest) == 1 and isinstance(rest[0], fx.Node):
        return None  # a whole shape computed at run time (x.view(y.shape))
    out = info(node)
    if not rest or out is None or len(rest) != len(out.shape):
        return None
    return rest if all(isinstance(a, (int, fx.Node)) for a in rest) else None


def _suffix(shape: Sequence[int]) -> list[int]:
    out = [1] * (len(shape) + 1)
    for i in range(len(shape) - 1, -1, -1):
        out[i] = out[i + 1] * shape[i]
    return out


def _recipe(ins: tuple, outs: tuple, dynamic: set[int]) -> list:
    """Each output size as the product of a run of input dims (a tuple of dims), a literal
    (a static size, or a size-1 dim), or -1 (the one dynamic size that splits an input
    dim): a reshape whose sizes follow the input at any shape, not the example's."""
    si, so = _suffix(ins), _suffix(outs)
    recipe: list = []
    for k, size in enumerate(outs):
        starts = [i for i in range(len(ins) + 1) if si[i] == so[k]]
        ends = [i for i in range(len(ins) + 1) if si[i] == so[k + 1]]
        if starts and ends and min(ends) > max(starts):
            dims = tuple(range(max(starts), min(ends)))
            n = 1
            for d in dims:
                n *= ins[d]
            if n == size:
                recipe.append(dims)
                continue
        if size == 1 and k not in dynamic:
            recipe.append(1)
        elif k not in dynamic:
            recipe.append(size)
        else:
            recipe.append(-1)
    return recipe


def _evaluate(recipe: list, ins: tuple) -> list[int] | None:
    numel = 1
    for s in ins:
        numel *= s
    out, rest = [], None
    for item in recipe:
        if isinstance(item, tuple):
            n = 1
            for d in item:
                n *= ins[d]
            out.append(n)
        elif item == -1:
            rest = len(out)
            out.append(-1)
        else:
            out.append(item)
    if rest is not None:
        known = 1
        for i, s in enumerate(out):
            if i != rest:
                known *= s
        if known == 0 or numel % known:
            return None
        out[rest] = numel // known
    return out


def collapsed_shape(chain: list[fx.Node]) -> tuple[list | None, str | None]:
    """The shape argument of the one reshape that replaces `chain`, or the reason none can
    be written down. Items are ints, -1, size nodes the graph computes, or tuples of input
    dims whose sizes multiply (`shape_args` turns those into graph nodes)."""
    last = chain[-1]
    spelled = _spelled_shape(last)
    if spelled is not None:
        return spelled, None
    for n in chain:
        found: list[fx.Node] = []
        fx.node.map_arg((n.args[1:], n.kwargs), found.append)
        if found:
            return None, (
                f"the shape {last.name} produces follows {found[0].name}, a size "
                "read at run time; one reshape would fix it to the captured size"
            )
    ins, outs = shapes_seen(chain[0].args[0]), shapes_seen(last)
    if not ins or len(ins) != len(outs):
        return None, f"the shapes around {last.name} are not known at every probed size"
    dynamic = dynamic_dims(last)
    # align at each run in turn (a size-1 dim can hide a match); last, the output's static
    # sizes as they are with its one dynamic size as -1
    recipes = [_recipe(ins[r], outs[r], dynamic) for r in range(len(ins))]
    recipes.append([-1 if k in dynamic else size for k, size in enumerate(outs[0])])
    for recipe in recipes:
        if sum(1 for x in recipe if x == -1) > 1:
            continue
        if all(_evaluate(recipe, i) == list(o) for i, o in zip(ins, outs, strict=True)):
            return recipe, None
    return None, (
        f"the shape {last.name} produces splits a dynamic size in a way one "
        "reshape cannot follow at every batch or sequence length"
    )


def _collapsed(chain: list[fx.Node]) -> Found | Refused | None:
    if same_everywhere(chain[0].args[0], chain[-1]):  # at the example and every probe
        return chain_found(chain, "leave the shape unchanged", {"identity": True})
    if len(chain) == 1:
        return None
    shape, reason = collapsed_shape(chain)
    if reason:
        return Refused(reason, chain[-1])
    assert shape is not None  # collapsed_shape gives either a shape or a reason
    src = cast(fx.Node, chain[0].args[0]).name
    shown = [
        a.name
        if isinstance(a, fx.Node)
        else "*".join(f"{src}.size({d})" for d in a)
        if isinstance(a, tuple)
        else a
        for a in shape
    ]
    return chain_found(chain, f"as one reshape to {shown}", {"identity": False}, shape=shape)


@register
class CollapseView(LayoutRule):
    name = "layout.collapse_view"
    training = True
    relieves = ("memory:data-movement",)
    description = (
        "Chains of view/reshape/flatten/(un)squeeze become one reshape to the final shape, "
        "and a view to the shape a tensor already has is removed. All of them keep elements "
        "in row-major order, so one reshape of the chain's input gives the same tensor. "
        "They are views: this saves op dispatches, not memory traffic."
    )

    anchors = ("view", "reshape", "flatten", "squeeze")

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Verdict | Sequence[Found | Refused]:
        return chain_check(node, is_shape_op, _collapsed)

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        chain = found.nodes
        if found["identity"]:
            replace_chain(gm, chain, None, None)
            return
        with gm.graph.inserting_before(chain[-1]):
            src = cast(fx.Node, chain[0].args[0])
            shape = shape_args(gm.graph, chain[-1], src, found["shape"])
        replace_chain(gm, chain, "reshape", shape)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        saved = len(found.nodes) - (0 if found["identity"] else 1)
        return bytes_estimate(0, target, f"views move no data; {fewer(saved)}", views_saved=saved)
