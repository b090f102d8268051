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
from opswap.graph.ops import copy_meta, is_aten, op_kind, raw_name
from opswap.graph.shapes import info
from opswap.rules import Estimate, Miss, Rule, Site, register
from opswap.rules.base import node_by_name
from opswap.targets import get_target

_IN_PLACE = ("mul_", "imul", "__imul__", "sigmoid_")


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

    def _check(self, gm: fx.GraphModule, mul: fx.Node):
        """(x, sigmoid) or a reason; None when `mul` is not x * sigmoid(x)."""
        if op_kind(mul) != "mul" or len(mul.args) != 2 or mul.kwargs:
            return None
        a, b = mul.args
        pair = next(((x, s) for x, s in ((a, b), (b, a)) if isinstance(s, fx.Node)
                     and op_kind(s) == "sigmoid" and s.args and s.args[0] is x), None)
        if pair is None:
            return None
        x, sig = pair
        if raw_name(mul) in _IN_PLACE or raw_name(sig) in _IN_PLACE:
            return (f"{mul.name if raw_name(mul) in _IN_PLACE else sig.name} writes in place "
                    f"into {x.name}, which silu would leave unchanged")
        others = [u.name for u in sig.users if u is not mul]
        if others:
            return (f"{sig.name}'s output is also read by {', '.join(others[:3])}, so the "
                    "sigmoid would still run")
        x_info = info(x)
        if x_info is None or not x_info.dtype.is_floating_point:
            return f"{x.name} is not a floating-point tensor; silu takes only those"
        return x, sig

    def match(self, gm: fx.GraphModule) -> list[Site | Miss]:
        def site_of(mul, checked) -> Site:
            x, sig = checked
            return self.site(f"{sig.name}+{mul.name}", [sig, mul],
                             f"{x.name} * sigmoid({x.name}) -> silu({x.name})",
                             x=x.name, sigmoid=sig.name, mul=mul.name)

        return self.scan(gm, self._check, site_of)

    def rewrite(self, gm: fx.GraphModule, site: Site) -> None:
        mul, sig = node_by_name(gm, site.data["mul"]), node_by_name(gm, site.data["sigmoid"])
        x = sig.args[0]  # not by name: x may be the output of a site rewritten before this one
        silu = torch.ops.aten.silu.default if is_aten(mul) else F.silu
        with gm.graph.inserting_before(mul):
            new = gm.graph.call_function(silu, (x,))
        copy_meta(new, mul)
        mul.replace_all_uses_with(new)
        gm.graph.erase_node(mul)
        gm.graph.erase_node(sig)  # the check made sure the mul was its only reader

    def predict(self, gm: fx.GraphModule, site: Site, target) -> Estimate:
        sig, mul = node_by_name(gm, site.data["sigmoid"]), node_by_name(gm, site.data["mul"])
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
