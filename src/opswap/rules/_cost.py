"""What a rewrite saves, in the cost model's terms.

Every op in the cost model is costed as if it ran alone: it reads its inputs
from memory and writes its output back. A fusion removes ops (a folded
BatchNorm, a ReLU done in a GEMM's epilogue) or replaces several with one; the
saving is the roofline time of what is removed minus that of what is added,
each kernel timed as max(flops / peak, bytes / bandwidth) plus the target's
per-op dispatch cost (`Target.dispatch_s`), so merging three GEMMs into one saves
two dispatches even when the FLOPs stay. A rewrite that only removes data
movement (a copy, a layout conversion) is costed by its bytes and the ops it removes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost, roofline_point
from opswap.cost.analyze import dispatches
from opswap.graph.shapes import info
from opswap.rules.base import Estimate
from opswap.targets.base import Target


def op_time(c: NodeCost, target: Target, dtype: torch.dtype | str) -> float:
    """Roofline time of one kernel of cost `c` at `dtype`'s peak, plus its dispatch."""
    overhead = (
        target.op_overhead(bool(c.flops or c.bytes)) if hasattr(target, "op_overhead") else 0.0
    )
    return roofline_point(c.flops, c.bytes, target, dtype).time_s + overhead


def costs(nodes: Iterable[fx.Node]) -> list[NodeCost]:
    return [node_cost(n) for n in nodes]


def saving(
    target: Target, removed: Iterable[fx.Node], added: Iterable[NodeCost] = (), note: str = ""
) -> Estimate:
    """Estimate for replacing the ops `removed` (each a kernel of its own) by the
    kernels `added` (given as costs: they do not exist in the graph yet)."""
    removed = list(removed)
    dtype = next((i.dtype for i in map(info, removed) if i is not None), "float32")
    gone = costs(n for n in removed if dispatches(n))
    new = list(added)
    flops = sum(c.flops for c in gone) - sum(c.flops for c in new)
    nbytes = sum(c.bytes for c in gone) - sum(c.bytes for c in new)
    t_gone = sum(op_time(c, target, dtype) for c in gone)
    t_new = sum(op_time(c, target, dtype) for c in new)
    dt = t_gone - t_new
    if abs(dt) <= 1e-9 * max(t_gone, t_new):
        # k compute-bound GEMMs merged into one: equal times up to float rounding, which
        # must not read as "slower" to the planner
        dt = 0.0
    return Estimate(float(flops), float(nbytes), dt, note)


def moved_bytes(nodes: Iterable[fx.Node]) -> int:
    """Bytes the cost model says these nodes move per call (0 for views and no-ops)."""
    total = 0
    for n in nodes:
        try:
            total += node_cost(n).bytes
        except Exception:  # a node created earlier in this pass has no shapes yet
            i = info(n)
            total += 2 * i.nbytes if i is not None else 0
    return total


def bytes_estimate(
    bytes_saved: int, target: Target, note: str, kernels_saved: int = 0, views_saved: int = 0
) -> Estimate:
    """Estimate for a rewrite that saves `bytes_saved` of memory traffic and no FLOPs, and
    the dispatch of `kernels_saved` ops that move data and `views_saved` that do not
    (negative: ops added)."""
    bw = getattr(target, "mem_bandwidth", None)
    if not bw:
        return Estimate(bytes_saved=float(bytes_saved), time_saved_s=None, note=note)
    dispatch = (
        getattr(target, "dispatch_s", 0.0) * kernels_saved
        + getattr(target, "view_dispatch_s", 0.0) * views_saved
    )
    return Estimate(
        bytes_saved=float(bytes_saved), time_saved_s=bytes_saved / bw + dispatch, note=note
    )
