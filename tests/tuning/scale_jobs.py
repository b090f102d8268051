"""Job functions for tests/tuning/test_scale.py, in a module of their own so that spawned
workers import them by a plain name (the test adds this folder to their path)."""

from __future__ import annotations

import torch


def fake_time(n: int, width: int) -> tuple[float, float]:
    """A deterministic stand-in timer: a plan of n sites at a width takes this long."""
    return 1e-3 * n + 1e-6 * width * width, 0.01 * n


def failing(n: int) -> tuple[float, float]:
    raise ValueError(f"no kernel for {n}")


def threads() -> tuple[float, float]:
    """Seconds = the worker's torch thread count (the pinning to one thread)."""
    return float(torch.get_num_threads()), 0.0
