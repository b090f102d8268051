"""NodeCost: the FLOPs and bytes of one FX node, the unit every other cost is summed from."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from opswap.cost.flops import node_flops
from opswap.cost.traffic import node_traffic
from opswap.graph.ops import is_compute, op_kind


@dataclass(frozen=True)
class NodeCost:
    """FLOPs (multiply-add = 2) and bytes moved (read + written) by one op run alone."""

    flops: int
    bytes: int
    read: int = 0
    written: int = 0
    note: str = ""

    @property
    def intensity(self) -> float:
        """FLOP per byte; inf for an op that computes without touching memory, 0 for a free op."""
        if self.bytes == 0:
            return float("inf") if self.flops else 0.0
        return self.flops / self.bytes

    def __add__(self, other: NodeCost) -> NodeCost:
        return NodeCost(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.read + other.read,
            self.written + other.written,
        )


ZERO = NodeCost(0, 0)


def node_cost(node: fx.Node) -> NodeCost:
    """Cost of one node of a captured graph (FX or export flavour; shapes must be propagated).

    Placeholders, outputs, constants and shape queries cost nothing.
    """
    if not is_compute(node):
        return ZERO
    flops = int(node_flops(node))
    traffic = node_traffic(node)
    note = traffic.note
    kind = op_kind(node)
    if kind.startswith("unknown:"):
        what = kind.split(":", 1)[1]
        if node.op == "call_module":
            counted = "counted by FlopCounterMode" if flops else "not counted"
            note = f"unrecognised module {what}: FLOPs {counted}"
        elif not flops:
            note = f"unrecognised op {what}: FLOPs not counted"
    return NodeCost(flops, traffic.total, traffic.read, traffic.written, note)
