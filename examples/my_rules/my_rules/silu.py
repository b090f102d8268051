"""my_rules.silu: x * sigmoid(x), written out (Swish), -> silu(x), one kernel.

Written out, Swish runs two kernels: sigmoid reads x and writes s, the mul reads x
and s and writes the result, 5 tensors of traffic. silu reads x once and writes
once: 2 tensors, and one dispatch instead of two. Same formula: the outputs differ
by rounding only (silu computes x / (1 + exp(-x)) in one pass).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from opswap.cost import NodeCost, node_cost, roofline_point
from opswap.graph.ops import copy_meta, is_aten
from opswap.graph.shapes import info
from opswap.rules import Estimate, Found, Refused, Rule, register
from opswap.rules.pattern import op, var
from opswap.targets import get_target


@register
class SiLU(Rule):
    """x * sigmoid(x) (either order, any capture flavour) -> silu(x)."""

    # a plugin's rules are named after the package, so they never collide with opswap's
    name = "my_rules.silu"
    family = "my_rules"
    chapter = 9  # activations
    exactness = "exact"
    targets = ("any",)
    description = ("x * sigmoid(x) written out (Swish) -> silu(x): one kernel that reads x "
                   "once, instead of a sigmoid and a mul that write and re-read its result.")
    relieves = ("memory", "overhead")
    # mul's operands match in either order; the same name twice is the same tensor. The base
    # class refuses in-place writes read afterwards and sigmoids other ops also read.
    pattern = op("mul", var("x"), op("sigmoid", var("x")))

    def check(self, gm: fx.GraphModule, mul: fx.Node) -> Found | Refused | None:
        m = self.pattern.match(gm, mul)
        if m is None or mul.kwargs:
            return None
        x = m["x"]
        x_info = info(x)
        if x_info is None or not x_info.dtype.is_floating_point:
            return Refused(f"{x.name} is not a floating-point tensor; silu takes only those")
        sig = m.nodes[0]
        return Found(m.nodes, f"{x.name} * sigmoid({x.name}) -> silu({x.name})", dict(x=x),
                     record=dict(x=x.name, sigmoid=sig.name, mul=mul.name))

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        sig, mul = found.nodes
        silu = torch.ops.aten.silu.default if is_aten(mul) else F.silu
        with gm.graph.inserting_before(mul):
            new = gm.graph.call_function(silu, (found["x"],))
        copy_meta(new, mul)
        mul.replace_all_uses_with(new)
        gm.graph.erase_node(mul)
        gm.graph.erase_node(sig)  # the base made sure the mul was its only reader

    def predict(self, gm: fx.GraphModule, found: Found, target) -> Estimate:
        sig, mul = found.nodes
        dtype, target = info(mul).dtype, get_target(target)
        before = [node_cost(sig), node_cost(mul)]
        # silu does the same arithmetic, and moves what the sigmoid alone moved
        after = NodeCost(sum(c.flops for c in before), before[0].bytes)

        def seconds(c: NodeCost) -> float:
            return roofline_point(c.flops, c.bytes, target, dtype).time_s + \
                target.op_overhead(True)

        return Estimate(flops_saved=0.0, bytes_saved=float(sum(c.bytes for c in before)
                                                           - after.bytes),
                        time_saved_s=sum(map(seconds, before)) - seconds(after),
                        note="one silu kernel instead of a sigmoid and a mul")
