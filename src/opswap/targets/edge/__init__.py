"""Edge targets: delegates' op sets as data (profiles) and the delegation analysis.

>>> from opswap.targets.edge import get_profile
>>> get_profile("xnnpack").takes("convolution")
True
"""

from __future__ import annotations

from opswap.targets.edge.delegation import Delegation, OpRow, delegation, op_name, time_ops
from opswap.targets.edge.profiles import (
    EDGE_TARGETS,
    LAYOUT_OPS,
    PROFILES,
    EdgeProfile,
    get_profile,
)

__all__ = [
    "EDGE_TARGETS",
    "LAYOUT_OPS",
    "PROFILES",
    "Delegation",
    "EdgeProfile",
    "OpRow",
    "delegation",
    "get_profile",
    "op_name",
    "time_ops",
]
