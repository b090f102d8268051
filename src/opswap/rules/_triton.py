"""What the rules that install one of opswap's Triton row kernels (the norm rules,
activation.swiglu) share: their common class attributes (`TritonRule`) and the prediction,
by target.

- A CPU (any target that is not CUDA): the op runs its PyTorch reference there, the same
  ops as before plus one dispatch, so the site is predicted slower by that dispatch and
  the planner skips it with the reason.
- A CUDA target: the measured crossover table (kernels/crossover.py) decides when it has
  an entry for the kernel, device class, dtype and shape; without one, the roofline
  prediction (the replaced ops' bytes and launches against the one kernel's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.fx as fx

from opswap.cost import NodeCost
from opswap.kernels import crossover
from opswap.rules._cost import saving
from opswap.rules.base import Estimate, Rule
from opswap.targets.base import Target


class TritonRule(Rule):
    """A rule that swaps ops for an opswap Triton kernel: exact (fp32 math inside; sums in
    another order), forward and backward, after the fusions unless it says otherwise."""

    training = True
    implementation = "triton"
    exactness = "exact"
    targets = ("cuda", "cpu")
    after: ClassVar[tuple[str, ...]] = ("fusion.*",)


CPU_REASON = "the Triton kernel runs on CUDA; on this CPU the reference is what PyTorch runs"


def predict(
    target: Target,
    kernel: str,
    removed: Iterable[fx.Node],
    fused: NodeCost,
    dtype: torch.dtype,
    hidden: int,
    rows: int,
    note: str,
    pass_: str = "forward",
) -> Estimate:
    """The Estimate of replacing `removed` by the kernel of cost `fused` on `target`."""
    if getattr(target, "kind", "cpu") != "cuda":
        overhead = target.op_overhead(True) if hasattr(target, "op_overhead") else 0.0
        return Estimate(0.0, 0.0, -max(overhead, 1e-9), CPU_REASON)
    est = saving(target, removed, [fused], note)
    dev = crossover.device_class(target)
    entry = crossover.lookup(kernel, dev, dtype, hidden, rows, pass_)
    if entry is None:
        return dataclasses.replace(
            est, note=f"{note}; roofline (no measured crossover for {kernel} on {dev})"
        )
    if not entry.beats_eager:
        t = est.time_saved_s or 0.0
        return dataclasses.replace(
            est,
            time_saved_s=-max(abs(t), 1e-9),
            note=f"measured at {entry.speedup_vs_eager}x eager on {dev} ({entry.source})",
        )
    return dataclasses.replace(
        est,
        time_saved_s=max(est.time_saved_s or 0.0, 1e-9),
        note=f"{note}; measured at {entry.speedup_vs_eager}x eager on {dev} ({entry.source})",
    )
