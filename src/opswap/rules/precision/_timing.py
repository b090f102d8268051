"""Predictions by measurement for the precision rules on the machine opswap runs on.

A low-precision kernel's gain on a CPU moves with the instruction set (an AVX2 CPU
without VNNI multiplies int8 no faster than float32) and the thread count more than a
roofline follows, so for the `cpu` target (this machine, measured) a rule times the
layer both ways at the site's shape, with the target's timer, and caches the pair per
shape.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from opswap.targets.base import Timer

_CACHE: dict[tuple[Hashable, ...], tuple[float, float]] = {}


def is_this_cpu(target: Any) -> bool:
    """The measured target of the machine opswap runs on (not a datasheet or a test's)."""
    return (
        getattr(target, "name", "") == "cpu"
        and getattr(target, "kind", "") == "cpu"
        and getattr(target, "timer", None) is not None
    )


def timed_pair(
    key: tuple[Hashable, ...],
    timer: Timer,
    make: Callable[[], tuple[Callable[[], Any], Callable[[], Any]]],
) -> tuple[float, float]:
    """(before, after) seconds of the two calls `make()` builds, cached by `key` and the
    thread count."""
    full = (*key, torch.get_num_threads(), timer)
    hit = _CACHE.get(full)
    if hit is None:
        before, after = make()
        with torch.inference_mode():
            res = timer({"before": before, "after": after})
        hit = _CACHE[full] = (res["before"], res["after"])
    return hit
