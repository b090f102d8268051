"""fusion.log_softmax: log(softmax(x, dim)) -> log_softmax(x, dim)."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import is_aten, module_of, op_kind, raw_name
from opswap.rules._cost import saving
from opswap.rules._edits import replace_with
from opswap.rules._matching import input_of, setting
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

aten = torch.ops.aten


def _softmax_dim(gm: fx.GraphModule, sm: fx.Node) -> tuple[int, torch.dtype | None, bool] | str:
    """(dim, dtype or None, half_to_float) of a softmax node, or a reason string."""
    if sm.op == "call_module":
        dim = getattr(module_of(sm), "dim", None)
        dtype, half = None, False
    elif raw_name(sm) == "_safe_softmax":
        return (
            f"{sm.name} is a masked (_safe_softmax) softmax, which returns 0 on fully "
            "masked rows where log_softmax would return NaN"
        )
    elif raw_name(sm) == "_softmax":
        dim, dtype, half = setting(sm, "dim", None), None, bool(setting(sm, "half_to_float", 0))
    else:
        dim, dtype, half = setting(sm, "dim", None), setting(sm, "dtype", None), False
    if dim is None:
        return (
            f"{sm.name} is a softmax with an implicit dim (deprecated), so the dim "
            "log_softmax should use is not known"
        )
    if not isinstance(dim, int) or isinstance(dtype, fx.Node):
        return f"the dim of {sm.name} is computed at run time"
    return dim, dtype, half


@register
class LogSoftmax(Rule):
    """log(softmax(x, dim)) -> log_softmax(x, dim).

    One kernel instead of two (the softmax output is no longer written and read
    back), and more accurate: log_softmax computes x - max - log(sum(exp(x - max)))
    directly, where log(softmax(x)) rounds tiny probabilities to 0 and returns -inf.
    When the softmax output is also read elsewhere, the softmax stays for those
    readers and only the log is replaced (same traffic, better accuracy).
    """

    name = "fusion.log_softmax"
    training = True
    family = "fusion"
    chapter = 4
    exactness = "exact"
    relieves = ("memory:softmax",)
    description = (
        "log(softmax(x, dim)) -> log_softmax(x, dim): one kernel instead of two "
        "(the probabilities are not written and re-read) and numerically more "
        "stable (no log(0) = -inf for tiny probabilities)."
    )

    anchors = ("log",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        sm = input_of(node)
        if sm is None or op_kind(sm) != "softmax":
            return None
        checked = _softmax_dim(gm, sm)
        if isinstance(checked, str):
            return Refused(checked)
        shared = [u.name for u in sm.users if u is not node]
        desc = f"replace log({sm.name}) by log_softmax"
        if shared:
            desc += f" ({sm.name} stays: {', '.join(shared[:3])} also read it)"
        return Found(
            (node,) if shared else (sm, node),
            desc,
            dict(sm=sm, dim=checked, shared=bool(shared)),
            key=f"{sm.name}+{node.name}",
            record=dict(softmax=sm.name, log=node.name, shared=bool(shared)),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        log, sm = found.nodes[-1], found["sm"]
        dim, dtype, half = found["dim"]
        x = input_of(sm)
        args: tuple
        kwargs = {}
        if sm.op == "call_module" or not is_aten(sm):
            op, args = torch.log_softmax, (x, dim)
            kwargs = {"dtype": dtype} if dtype is not None else {}
        elif raw_name(sm) == "_softmax":
            op, args = aten._log_softmax.default, (x, dim, half)
        else:
            op, args = aten.log_softmax.int, (x, dim, dtype) if dtype is not None else (x, dim)
        replace_with(gm, log, op, args, kwargs, remove=[log, sm])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        log, sm = found.nodes[-1], found["sm"]
        c_sm, c_log = node_cost(sm), node_cost(log)
        # log_softmax reads x and writes the result: the bytes of the log alone
        fused = NodeCost(c_sm.flops + c_log.flops, c_log.bytes)
        removed = [log] if found["shared"] else [sm, log]
        note = (
            "softmax kept for its other readers; the log becomes log_softmax"
            if found["shared"]
            else "softmax probabilities no longer written and re-read"
        )
        return saving(target, removed, [fused], note)
