"""Graph capture, op taxonomy and shapes."""

from opswap.graph.capture import Captured, capture
from opswap.graph.ops import CATEGORIES, category, compute_nodes, op_kind
from opswap.graph.shapes import TensorInfo, info, infos

__all__ = [
    "CATEGORIES",
    "Captured",
    "TensorInfo",
    "capture",
    "category",
    "compute_nodes",
    "info",
    "infos",
    "op_kind",
]
