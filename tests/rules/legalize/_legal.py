"""What the legalisation tests share: the rules planned for the xnnpack edge target and
applied, checked against the user's module at the example's and other sizes (the GELU
tests' helper), and which ops of the applied graph the XNNPACK profile leaves outside."""

from __future__ import annotations

import torch
from torch import nn

from opswap.targets.edge import delegation

from ..activation._act import fired, reasons, run

__all__ = ["fired", "legal", "outside", "reasons"]


def legal(model: nn.Module, inputs: tuple, rule: str, method: str = "fx"):
    """(plan, applied, max abs, rel L2) for `rule` alone on the xnnpack target."""
    return run(model, inputs, [rule], method=method, target="xnnpack")


def outside(module: nn.Module, inputs: tuple) -> set[str]:
    """The compute ops XNNPACK's profile does not take in `module` exported at `inputs`."""
    ep = torch.export.export(module.eval(), inputs).run_decompositions()
    return {r.op for r in delegation(ep, "xnnpack").outside if r.compute}
