"""layout.drop_dropout: an eval-mode dropout returns its input, so it is removed."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch.fx as fx
from torch import nn

from opswap.graph.ops import arg, is_aten, module_of, op_kind, raw_name
from opswap.rules._cost import bytes_estimate
from opswap.rules._edits import erase
from opswap.rules.base import Estimate, Found, Refused, Verdict
from opswap.rules.layout._base import LayoutRule, fewer
from opswap.rules.registry import register
from opswap.targets.base import Target


def dropout_state(node: fx.Node) -> tuple[object, object, str] | None:
    """(p, training, label) of a dropout module or call, or None if the node is not one."""
    if node.op == "call_module":
        mod = module_of(node)
        if not isinstance(mod, nn.modules.dropout._DropoutNd):
            return None
        return mod.p, mod.training, str(node.target)
    if node.op not in ("call_function", "call_method") or op_kind(node) != "dropout":
        return None
    if raw_name(node) == "native_dropout":
        return None  # returns (output, mask): the mask has readers of its own
    if is_aten(node):
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    else:
        try:
            # a call_method's target is a method name, which signature() refuses (TypeError)
            target = cast(Callable[..., Any], node.target)
            bound = inspect.signature(target).bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            p, training = bound.arguments.get("p", 0.5), bound.arguments.get("training", True)
        except (TypeError, ValueError):
            p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
    return p, training, _module_path(node)


def _module_path(node: fx.Node) -> str:
    """The Dropout module an exported call came from ('encoder.drop'), else the node name."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        if "Dropout" in getattr(cls, "__name__", str(cls)) and path:
            return str(path)
    return node.name


@register
class DropDropout(LayoutRule):
    name = "layout.drop_dropout"
    phase = "early"  # a clean-up the other rules match better after
    description = (
        "Dropout in eval mode (nn.Dropout in eval, F.dropout(training=False), "
        "aten.dropout(x, p, False)) returns its input, so the op is removed. Nothing is "
        "copied either way: this saves a dispatch (and a module call) and lets the ops on "
        "either side fuse."
    )

    anchors = ("dropout",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Verdict:
        state = dropout_state(node)
        if state is None:
            return None
        p, training, label = state
        if isinstance(training, fx.Node) or isinstance(p, fx.Node):
            return Refused(f"Dropout {label}'s mode is decided at run time")
        if training and p != 0:
            return Refused(
                f"Dropout {label} is in training mode: it zeroes activations at "
                "random; call .eval() to remove it"
            )
        return Found(
            (node,), f"Dropout {label} " + ("is in eval mode" if not training else "has p = 0")
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        (node,) = found.nodes
        node.replace_all_uses_with(
            cast(fx.Node, node.args[0] if node.args else node.kwargs["input"])
        )
        erase(gm, [node])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return bytes_estimate(
            0,
            target,
            f"eval-mode dropout returns its input: no data moves; {fewer(1)}",
            views_saved=1,
        )
