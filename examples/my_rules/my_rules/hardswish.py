"""my_rules.hardswish: x * relu6(x + 3) / 6, written out, -> hardswish(x), one kernel.

Written out, hard-swish runs three kernels (the add, the clamp, the mul and the divide
each read and write a tensor of x's size: four ops, eight tensors of traffic).
`F.hardswish` reads x once and writes once. Same formula: the outputs differ by rounding
only. A plugin rule, as a user would write one: it uses only opswap's public helpers.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from opswap.cost import NodeCost, node_cost, roofline_point
from opswap.graph.ops import copy_meta, is_aten, module_of
from opswap.graph.shapes import info
from opswap.rules import Estimate, Found, Refused, Rule, register
from opswap.rules.pattern import const, op, var
from opswap.targets import get_target


def _clamps_to_six(node: fx.Node) -> bool:
    """relu6, or hardtanh (what torch.export makes of nn.ReLU6) between 0 and 6."""
    if node.op == "call_module":
        mod = module_of(node)
        return getattr(mod, "min_val", 0.0) == 0.0 and getattr(mod, "max_val", 6.0) == 6.0
    if "hardtanh" in str(node.target):
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
        high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
        return (low, high) == (0.0, 6.0)
    return True  # relu6 itself


@register
class HardSwish(Rule):
    """x * relu6(x + 3) / 6 (any operand order of the mul, any capture flavour) -> hardswish."""

    # a plugin's rules are named after the package, so they never collide with opswap's
    name = "my_rules.hardswish"
    family = "my_rules"
    chapter = 9  # activations
    exactness = "exact"
    targets = ("any",)
    description = (
        "x * relu6(x + 3) / 6 written out -> hardswish(x): one kernel that reads x "
        "once, instead of four that write and re-read tensors of its size."
    )
    relieves = ("memory:activation", "memory:elementwise")
    # the mul takes its operands in either order; the same name twice is the same tensor.
    # The base class refuses in-place writes read afterwards and values other ops read.
    pattern = op(
        "div",
        op("mul", var("x"), op(("relu6", "hardtanh"), op("add", var("x"), const("three")))),
        const("six"),
    )

    def check(self, gm: fx.GraphModule, div: fx.Node) -> Found | Refused | None:
        m = self.pattern.match(gm, div)
        if m is None or m["three"] != 3 or m["six"] != 6:
            return None
        clamp = m.nodes[1]
        if not _clamps_to_six(clamp):
            return Refused(f"{clamp.name} clamps to other bounds than [0, 6]")
        x = m["x"]
        x_info = info(x)
        if x_info is None or not x_info.dtype.is_floating_point:
            return Refused(f"{x.name} is not a floating-point tensor; hardswish takes only those")
        return Found(
            m.nodes,
            f"{x.name} * relu6({x.name} + 3) / 6 -> hardswish({x.name})",
            x=x,
            record=dict(x=x.name, out=div.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        div = found.nodes[-1]
        fn = torch.ops.aten.hardswish.default if is_aten(div) else F.hardswish
        with gm.graph.inserting_before(div):
            new = gm.graph.call_function(fn, (found["x"],))
        copy_meta(new, div)
        div.replace_all_uses_with(new)
        for n in reversed(found.nodes):  # the base made sure nothing else reads them
            gm.graph.erase_node(n)

    def predict(self, gm: fx.GraphModule, found: Found, target) -> Estimate:
        dtype, target = info(found.nodes[-1]).dtype, get_target(target)
        before = [node_cost(n) for n in found.nodes]
        # hardswish does the same arithmetic, and moves what the add alone moved
        after = NodeCost(sum(c.flops for c in before), before[0].bytes)

        def seconds(c: NodeCost) -> float:
            return roofline_point(c.flops, c.bytes, target, dtype).time_s + target.op_overhead(True)

        return Estimate(
            flops_saved=0.0,
            bytes_saved=float(sum(c.bytes for c in before) - after.bytes),
            time_saved_s=sum(map(seconds, before)) - seconds(after),
            note=f"one hardswish kernel instead of {len(before)}",
        )
