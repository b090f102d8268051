import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import replace_with
from opswap.rules.base import Estimate, Found, Refused, Rule, Verdict
from opswap.rules.pattern import op, var
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class SiLU(Rule):
    name, family, chapter, exactness = "fusion.silu", "fusion", 4, "exact"
    training = True
    description = "x * sigmoid(x) -> silu(x): one kernel, and sigmoid(x) is never stored."
    relieves = ("memory:activation", "memory:elementwise")
    pattern = op("mul", var("x"), op("sigmoid", var("x")))

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Verdict:
        m = self.pattern.match(gm, node)
        if m is None:
            return None
        x = info(m["x"])
        if x is not None and not x.dtype.is_floating_point:
            return Refused(f"{m['x'].name} is {x.dtype}; silu takes floating-point tensors")
        return Found(m.nodes, f"{node.name} = x * sigmoid(x) -> silu(x)", x=m["x"])

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        replace_with(gm, found.nodes[-1], "silu", (found["x"],), remove=found.nodes)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        # the mul's arithmetic moves into silu, its bytes go
        mul = found.nodes[-1]
        return saving(target, [mul], [NodeCost(node_cost(mul).flops, 0)], "sigmoid(x) not stored")
