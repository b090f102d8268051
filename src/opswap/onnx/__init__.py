"""ONNX in: models that arrive as .onnx files, analyzed, planned and optimized with
rewrite rules on the ONNX graph (chapter 21).

    load_onnx(path, sizes)      the file, checked (other opsets converted to 13-21), external
                                data, shapes, sizes that fit in memory and that it runs at
    analyze_onnx(model)         per op type: count and FLOPs
    plan_onnx(model, rules)     the rules in order on a copy: sites, misses, the new model
    optimize_onnx(model, ...)   plan, verify in ONNX Runtime, race ORT's own optimizer
    save_onnx(result, dir)      model.onnx, plan.json, result.json, report.md, report.html

The rules (opswap.onnx.rules, one per module, `onnx.<what>`) are onnxscript rewriter
rules with opswap's name, exactness and near-miss reasons. `opswap analyze|plan|optimize
model.onnx` call these functions.
"""

from __future__ import annotations

import importlib.util

from opswap.errors import SpecError

_MISSING = [
    m
    for m in ("onnx", "onnx_ir", "onnxscript", "onnxruntime")
    if importlib.util.find_spec(m) is None
]
if _MISSING:  # the rules subclass onnxscript's: nothing here imports without it
    raise SpecError(
        f"Reading .onnx models needs {', '.join(_MISSING)}: pip install 'opswap[onnx]'."
    )

from opswap.onnx.analyze import analyze_onnx  # noqa: E402
from opswap.onnx.load import load_onnx  # noqa: E402
from opswap.onnx.optimize import optimize_onnx  # noqa: E402
from opswap.onnx.optimize import save as save_onnx  # noqa: E402
from opswap.onnx.plan import plan_onnx  # noqa: E402

__all__ = ["analyze_onnx", "load_onnx", "optimize_onnx", "plan_onnx", "save_onnx"]
