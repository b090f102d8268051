"""Cost model: FLOPs and bytes per op, roofline bound and time share on a target.

>>> from opswap.cost import analyze, render
>>> a = analyze(captured, "h100")
>>> render(a)
"""

from opswap.cost.analyze import Analysis, CategorySummary, OpRow, analyze, render
from opswap.cost.flops import conv_flops, node_flops, sdpa_flops
from opswap.cost.node import NodeCost, node_cost
from opswap.cost.roofline import RooflinePoint, roofline_point
from opswap.cost.traffic import node_traffic
from opswap.cost.units import human, human_time, human_unit

__all__ = [
    "Analysis",
    "CategorySummary",
    "NodeCost",
    "OpRow",
    "RooflinePoint",
    "analyze",
    "conv_flops",
    "human",
    "human_time",
    "human_unit",
    "node_cost",
    "node_flops",
    "node_traffic",
    "render",
    "roofline_point",
    "sdpa_flops",
]
