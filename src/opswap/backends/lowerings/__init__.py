"""ONNX lowerings of opswap's own ops (`torch.ops.opswap.*`), for torch.onnx's exporter.

A rewrite leaves a registered op in the graph (`opswap::conv_relu`, `opswap::wo_linear`,
...), which torch.export keeps as one node and torch.onnx knows nothing of. Each op gets
an onnxscript function that the exporter calls through its `custom_translation_table`
(`table()`): a decomposition into standard ONNX ops with the op's own math, or an ONNX
Runtime contrib op where one computes exactly that and runs on the CPU execution
provider.

One module here per kernel module of opswap.kernels, with the same name, lowers the ops
that kernel registers; a module is found, not listed (every module of this package
whose name does not start with `_` is imported), and each function registers itself by
the op it lowers:

    @lowering("opswap::rms_norm", "ReduceMean + Sqrt + Div + Mul (float32 inside)")
    def rms_norm(x, weight, eps: float, offset: float, cast_first: bool): ...

An op that has no lowering says why instead (`no_lowering(op, reason, __name__)`): the
kernels' backward ops appear only in training graphs, which are not exported to a
runtime; `opswap::decode_attention` runs in opswap.llm's decode loop, in-process. Two
ATen ops that opswap's rewrites leave are lowered here too: `aten::_int_mm` (beside
int8_linear, which traces to it on VNNI CPUs) and `aten::_addmm_activation`
(linear_epilogue, after the rule that leaves it). `LOWERED` and `NOT_LOWERED` are read
from the registrations, and tests/backends/test_lowerings.py checks that every op under
`torch.ops.opswap` has one or the other.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from opswap.backends.lowerings._onnx import OPSET
from opswap.backends.lowerings._registry import (
    INT8_FORMS,
    TRAINING_ONLY,
    Lowering,
    Options,
    lowering,
    no_lowering,
    registered,
)

__all__ = [
    "INT8_FORMS",
    "LOWERED",
    "NOT_LOWERED",
    "OPSET",
    "TRAINING_ONLY",
    "Lowering",
    "Options",
    "lowering",
    "lowering_modules",
    "no_lowering",
    "registered",
    "table",
    "uncovered",
]


def lowering_modules() -> list[str]:
    """Dotted names of the modules that register lowerings: this package's public
    modules, in name order."""
    found = pkgutil.iter_modules(__path__)
    return [f"{__name__}.{m.name}" for m in sorted(found, key=lambda m: m.name) if m.name[0] != "_"]


for _module in lowering_modules():
    importlib.import_module(_module)

#: the ops that have a lowering, with the ONNX each becomes (docs and error messages)
LOWERED = {e.op: e.onnx for e in registered() if e.lowered}
#: the ops that have none, and why
NOT_LOWERED = {e.op: e.reason for e in registered() if not e.lowered}


def table(int8: str = "qdq") -> dict[Any, Any]:
    """The exporter's `custom_translation_table`: torch op overload -> onnxscript function.
    `int8`: the form of the static int8 Linear (INT8_FORMS)."""
    options = Options(int8)
    import onnxscript  # noqa: F401  (the lowerings write onnxscript: an ImportError here)

    import opswap.kernels  # noqa: F401  (registers torch.ops.opswap.*)

    return {e.overload(): e.translation(options) for e in registered() if e.lowered}


def uncovered(ops: list[str]) -> list[str]:
    """Those of `ops` ("namespace::name") that have neither a lowering nor a reason."""
    known = {e.op for e in registered()}
    return [o for o in ops if o not in known]
