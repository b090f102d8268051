"""Human-readable numbers: 12.3M, 4.5 GB/s."""

from __future__ import annotations

import math


def human(x: float | int | None, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    ax = abs(x)
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if ax >= scale:
            return f"{x / scale:.{digits}g}{prefix}{unit}"
    if isinstance(x, int) or float(x).is_integer():
        return f"{int(x)}{unit}"
    return f"{x:.{digits}g}{unit}"
