"""What the cost model sees of a site: roofline and shape features, from opswap.cost.

A site's features are computed once, when its candidates are timed, and kept in the
tuning record beside the times, so that the cost model trains from the database alone.
A candidate is the site's features plus the candidate's name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from opswap.cost import node_cost, roofline_point
from opswap.graph.ops import op_kind
from opswap.targets.base import Target
from opswap.tuning.db import Shapes

#: how many sizes of each of the first two tensors are features (padded with 1)
DIMS = 4
#: the numeric features, in the order the model reads them
NUMERIC: tuple[str, ...] = (
    "log_flops",
    "log_bytes",
    "log_intensity",
    "log_roofline_s",
    *(f"log_d{t}_{i}" for t in range(2) for i in range(DIMS)),
    "rank0",
    "rank1",
)
#: the categorical ones
CATEGORICAL: tuple[str, ...] = ("op", "dtype", "candidate")


def _log(x: float) -> float:
    return math.log(max(float(x), 1e-30))


def site_features(
    gm: fx.GraphModule, nodes: Sequence[fx.Node], shapes: Shapes, dtype: str, target: Target
) -> dict[str, Any]:
    """FLOPs, bytes, arithmetic intensity and roofline seconds on `target` of the site's
    nodes (summed), the sizes of its first two tensors, its dtype and its anchor's op kind."""
    flops = bytes_ = 0
    for n in nodes:
        c = node_cost(n)
        flops += c.flops
        bytes_ += c.bytes
    point = roofline_point(flops, bytes_, target, dtype if dtype != "none" else "float32")
    out: dict[str, Any] = {
        "log_flops": _log(flops + 1),
        "log_bytes": _log(bytes_ + 1),
        "log_intensity": _log((flops + 1) / (bytes_ + 1)),
        "log_roofline_s": _log(point.time_s + 1e-12),
        "op": op_kind(nodes[0]) if nodes else "none",
        "dtype": dtype,
    }
    for t in range(2):
        shape = shapes[t] if t < len(shapes) else ()
        out[f"rank{t}"] = float(len(shape))
        padded = (*shape[:DIMS], *([1] * (DIMS - len(shape[:DIMS]))))
        for i, d in enumerate(padded):
            out[f"log_d{t}_{i}"] = _log(max(d, 1))
    return out
