"""opswap: operator replacement for PyTorch models.

Find the operators that cost the most, swap them for faster equivalents, prove
the numbers still match, and measure the gain. See README.md.

    import opswap
    loaded = opswap.load("zoo:resnet")
    result = opswap.optimize(loaded.module, loaded.example_inputs, target="cpu")
"""

from __future__ import annotations

__version__ = "0.1.0"

# `opswap.verify` and `opswap.bench` are both subpackages and API functions. Python binds a
# subpackage onto its parent the first time it is imported, which would replace the
# function; importing the subpackages first and binding the functions after makes the
# functions win for good (`from opswap.verify import compare` still reaches the package).
import opswap.bench as _bench_package  # noqa: E402, F401
import opswap.verify as _verify_package  # noqa: E402, F401
from opswap import rules  # noqa: E402  (the rules package: all_rules(), get(), Rule ...)
from opswap.api import analyze, apply, bench, load, optimize, plan, verify  # noqa: E402

__all__ = ["analyze", "apply", "bench", "load", "optimize", "plan", "rules", "verify"]
