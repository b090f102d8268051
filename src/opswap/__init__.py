"""opswap: operator replacement for PyTorch models.

Find the operators that cost the most, swap them for faster equivalents, prove
the numbers still match, and measure the gain. See README.md.

    import opswap
    loaded = opswap.load("zoo:resnet")
    result = opswap.optimize(loaded.module, loaded.example_inputs, target="cpu")
    result.save("out/resnet")
    fast = opswap.load_optimized("out/resnet")   # the saved winner; run it under inference_mode

`opswap.verify` and `opswap.bench` are packages that can be called like the
functions in opswap.api; `opswap.rules` is the rules package (`all_rules()`).
"""

from __future__ import annotations

from opswap import api as _api
from opswap import bench, rules, verify

# opswap.kernels registers torch.ops.opswap.*: a saved model.pt2 that calls them then
# loads with a plain torch.export.load
from opswap import kernels as _kernels  # noqa: F401
from opswap._callable import make_callable
from opswap._version import __version__ as __version__
from opswap.api import analyze, apply, export, load, optimize, plan
from opswap.deploy import load_optimized

__all__ = [
    "analyze",
    "apply",
    "bench",
    "export",
    "load",
    "load_optimized",
    "optimize",
    "plan",
    "rules",
    "verify",
]

# `opswap.verify(reference, candidate, example_inputs, ...)` calls opswap.api.verify, and
# `opswap.bench(...)` opswap.api.bench
make_callable(verify, _api.verify)
make_callable(bench, _api.bench)
