"""Human-readable numbers: 12.3M, 4.2 GB, 1.5 ms."""

from __future__ import annotations

import math

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def human(x: float, digits: int = 1) -> str:
    """12345678 -> '12.3M'; 950 -> '950'; decimal (SI) prefixes."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "inf"
    for scale, prefix in _PREFIXES:
        if abs(x) >= scale:
            return f"{x / scale:.{digits}f}{prefix}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.{digits}f}"


def human_unit(x: float, unit: str, digits: int = 1) -> str:
    """human() with a unit: 12.3e6, 'FLOP' -> '12.3 MFLOP'; 512, 'B' -> '512 B'."""
    s = human(x, digits)
    if s[-1:].isalpha() and s not in ("inf",):
        return f"{s[:-1]} {s[-1]}{unit}"
    return f"{s} {unit}"


def human_time(seconds: float) -> str:
    """0.0000123 -> '12.3 us'."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e9:.1f} ns"
