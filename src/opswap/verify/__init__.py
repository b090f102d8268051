"""Proving the numbers still match (chapter 23): metrics, tolerances, end-to-end and
layer-by-layer comparison, and bisection of a plan to roll back what breaks it."""

from opswap.verify.bisect import Rollback, find_culprit, rollback
from opswap.verify.layers import Divergence, LayerReport, LayerRow, compare_layers
from opswap.verify.metrics import Metrics, combine, compare
from opswap.verify.outputs import OutputCheck, Verification, verify
from opswap.verify.samples import make_samples
from opswap.verify.tolerance import Tolerance, as_tolerance, parse_budget, tolerance_for

__all__ = [
    "Divergence",
    "LayerReport",
    "LayerRow",
    "Metrics",
    "OutputCheck",
    "Rollback",
    "Tolerance",
    "Verification",
    "as_tolerance",
    "combine",
    "compare",
    "compare_layers",
    "find_culprit",
    "make_samples",
    "parse_budget",
    "rollback",
    "tolerance_for",
    "verify",
]
