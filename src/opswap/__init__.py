"""opswap: operator replacement for PyTorch models.

Find the operators that cost the most, swap them for faster equivalents, prove
the numbers still match, and measure the gain. See README.md.

The public functions live in `opswap.api` and are imported on first use, so
`import opswap.graph` (or the CLI's --help) does not pay for the whole package.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["analyze", "apply", "bench", "load", "optimize", "plan", "rules", "verify"]


def __getattr__(name: str):
    if name in __all__:
        from opswap import api

        return getattr(api, name)
    raise AttributeError(f"module 'opswap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
