"""Timing that survives scrutiny: candidates side by side, interleaved, after warm-up.

The usual ways a speed-up is misreported, and what this module does about each:

- cold start (lazy init, allocator growth, oneDNN/cuDNN autotuning, first-call JIT):
  `warmup` untimed rounds of every candidate, then a calibration pass;
- drift (CPU frequency, thermal throttling, a neighbour process): candidates are
  timed round-robin within one process, the order rotated every round so none is
  always first after the others; the speed-up is the median of per-round ratios,
  which cancels drift slower than one round;
- clock resolution and per-call overhead: each sample repeats the call enough
  times to last at least `target_sample_s` (1 ms by default);
- asynchronous GPUs: on CUDA, samples are bracketed by CUDA events and the device
  is synchronised before each sample and before reading the events, so the time
  is GPU time of all queued work, not the time to enqueue it;
- outliers (a page fault, a GC pause): medians and interquartile ranges, not
  means; the Python GC is paused while timing;
- noise: every ratio comes with a 95% bootstrap interval (rounds resampled as
  pairs, the ratio of medians recomputed), and a ratio whose interval holds 1.0 is
  "within noise", not a speed-up;
- a busy machine: with `rel_width`, timing goes on until every interval is narrower than
  that fraction of its ratio; when time runs out first the result is `settled=False`, and
  what prints it says so (`UNSETTLED`) and leads with the interval's lower end.

`OPSWAP_MAX_TIME_S` in the environment caps how long any one timing loop may run (its
`min_time_s` and `max_time_s` both), whatever the caller asked for: a smoke run (the test
suite sets it to 1) then goes through every step of the pipeline without the seconds of
timing each step spends to settle its intervals. The figures of such a run are honest
but wide; the report and result.json carry them as they are.

No function here asserts anything about speed: tests check structure, not clocks.
The figures a run yields (medians, ratios, intervals) are in bench.stats; the device it
runs on is resolved and described by bench.device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from opswap.bench.device import describe_device, resolve_device
from opswap.bench.stats import BenchResult, Stats, bootstrap_ratio, narrow
from opswap.errors import OpswapError
from opswap.targets import Target
from opswap.tuning.timer import Measured


def time_cap() -> float | None:
    """Seconds from OPSWAP_MAX_TIME_S, or None when it is unset or empty. A value that is
    not a positive number is refused in one sentence."""
    raw = os.environ.get("OPSWAP_MAX_TIME_S", "").strip()
    if not raw:
        return None
    try:
        cap = float(raw)
    except ValueError:
        cap = -1.0
    if not cap > 0 or math.isinf(cap):
        raise OpswapError(
            f"OPSWAP_MAX_TIME_S must be a positive number of seconds; got {raw!r} "
            "(unset it to time as long as each measurement asks)."
        )
    return cap


class _Timer:
    """The clock `benchmark` reads; bench.noisy replaces it to test a busy machine."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.cuda = dev.type == "cuda"

    @staticmethod
    def now() -> float:
        """Seconds on the wall clock that decides when timing stops."""
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def time(self, fn: Callable[[], Any], inner: int) -> float:
        """Seconds for `inner` back-to-back calls."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.dev)  # nothing queued before us is counted
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        return (time.perf_counter_ns() - t0) / 1e9


def _calibrate(timer: _Timer, fn, target_s: float, max_inner: int) -> int:
    """Calls per sample so that one sample lasts at least `target_s`."""
    inner = 1
    for _ in range(6):
        t = timer.time(fn, inner)
        if t >= target_s or inner >= max_inner:
            break
        inner = min(max_inner, max(inner + 1, math.ceil(inner * 1.2 * target_s / max(t, 1e-9))))
    return inner


_CHECK_EVERY = 10


def _narrow(rounds: list[dict[str, float]], names: list[str], rel_width: float) -> bool:
    """Whether every ratio names[0] / name has a 95% interval narrower than rel_width of it."""
    base = [rd[names[0]] for rd in rounds]
    for name in names[1:]:
        other = [rd[name] for rd in rounds]
        lo, hi = bootstrap_ratio(base, other, resamples=200)
        mid = statistics.median(base) / max(statistics.median(other), 1e-30)
        if not narrow(lo, hi, mid, rel_width):
            return False
    return True


def benchmark(
    fns: dict[str, Callable[[], Any]],
    *,
    warmup: int = 3,
    repeats: int = 15,
    min_time_s: float = 0.2,
    max_time_s: float = 30.0,
    target_sample_s: float = 1e-3,
    max_inner: int = 10_000,
    max_rounds: int = 10_000,
    rel_width: float | None = None,
    device="cpu",
) -> BenchResult:
    """Time every function in `fns` in one process, interleaved.

    `warmup` untimed rounds, then at least `repeats` timed rounds, continuing until
    `min_time_s` has passed (but adding no round once `max_time_s` has passed).
    Each round times every candidate once, in an order rotated by one per round;
    each sample repeats the call so that it lasts at least `target_sample_s`.

    `rel_width`: on a noisy machine, keep adding rounds (up to `max_time_s`) until the
    95% interval of every function's time ratio to the first one is narrower than this
    fraction of the ratio, so that a figure is not reported with an interval that holds
    anything. The interval is checked every `_CHECK_EVERY` rounds; the result's `settled`
    says whether it narrowed before `max_time_s` (None without `rel_width`).
    """
    if not fns:
        raise OpswapError("Nothing to time: pass at least one function.")
    cap = time_cap()
    if cap is not None:
        min_time_s, max_time_s = min(min_time_s, cap), min(max_time_s, cap)
    dev = resolve_device(device)
    timer = _Timer(dev)
    names = list(fns)
    k = len(names)

    def rotated(r: int) -> list[str]:
        return names[r % k :] + names[: r % k]

    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        for r in range(warmup):
            for name in rotated(r):
                fns[name]()
        timer.sync()
        inner = {name: _calibrate(timer, fns[name], target_sample_s, max_inner) for name in names}

        rounds: list[dict[str, float]] = []
        order: list[list[str]] = []
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        settled = None if rel_width is None else False
        try:
            t_start = timer.now()
            r = 0
            while r < max_rounds:
                elapsed = timer.now() - t_start
                if (
                    r >= repeats
                    and elapsed >= min_time_s
                    and (
                        rel_width is None
                        or r % _CHECK_EVERY == 0
                        and _narrow(rounds, names, rel_width)
                    )
                ):
                    settled = None if rel_width is None else True
                    break
                if r >= min(repeats, 3) and elapsed >= max_time_s:
                    break
                this = rotated(r)
                rounds.append({n: timer.time(fns[n], inner[n]) / inner[n] for n in this})
                order.append(this)
                r += 1
        finally:
            if gc_was_enabled:
                gc.enable()

    if settled is False and rel_width is not None and len(rounds) >= 3:
        settled = _narrow(rounds, names, rel_width)  # the last rounds may have narrowed it
    stats = {n: Stats(n, [rd[n] for rd in rounds], inner[n]) for n in names}
    return BenchResult(stats, rounds, order, describe_device(dev), warmup, settled, rel_width)


def _fastest_measured(fns: dict[str, Callable[[], Any]], device: str = "cpu") -> Measured:
    """`fastest`'s times with how many rounds they took and their spread (the largest
    interquartile range over the median of any function)."""
    res = benchmark(fns, warmup=2, repeats=5, min_time_s=0.1, max_time_s=1.0, device=device)
    spread = max((res[n].q3 - res[n].q1) / max(res[n].median, 1e-30) for n in fns)
    return Measured({name: res[name].min for name in fns}, len(res.rounds), spread)


def fastest(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """The fastest seconds per call of each of `fns`, over interleaved rounds lasting about
    a tenth of a second: a CPU target's timer. The fastest, not the median: with only a
    few rounds of a large function, another process on the machine (a parallel test run,
    a compile) can fill most of them, and interference only ever adds time."""
    return _fastest_measured(fns).times


def fastest_cuda(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """`fastest` on the current CUDA device: each sample bracketed by CUDA events, so a
    time is the GPU's time for the queued work, not the time to enqueue it."""
    return _fastest_measured(fns, "cuda").times


def with_timer(target: Target, tuning_db: str | None = None, top_k: int | None = None) -> Target:
    """`target` able to time functions on this machine, for the rules that measure a site
    there (precision.int8_linear on the `cpu` target, conv.algorithm): a CPU target gets
    `fastest`; a CUDA target gets `fastest_cuda` when this machine's GPU is of the class
    the target names (an H100 profile on an sm90 device), else none (a datasheet target
    planned on another machine: estimate only).

    The timer goes through the tuning database (opswap.tuning): `tuning_db` names its
    file, "off" turns it off, None is the default (OPSWAP_TUNING_DB, else the user's
    cache directory). `top_k`: a site with more candidates than that times only the
    `top_k` the learned cost model ranks first (tuning.costmodel), with the baseline."""
    if target.timer is not None:
        return target
    kind = None
    if target.kind == "cpu":
        kind = "cpu"
    elif target.kind == "cuda" and torch.cuda.is_available():
        from opswap.kernels.crossover import device_class

        here = device_class(torch.device("cuda"))
        if device_class(target) in (here, "cuda"):  # "cuda": a profile of no named class
            kind = "cuda"
    if kind is None:
        return target
    from opswap.tuning import TuningDB, resolve_path, tuned
    from opswap.tuning.costmodel import ranker

    path = resolve_path(tuning_db)
    db = TuningDB(path) if path is not None else None
    rank = ranker(db) if db is not None and top_k is not None else None

    def measure(fns: dict[str, Callable[[], object]]) -> Measured:
        return _fastest_measured(fns, kind)

    return dataclasses.replace(target, timer=tuned(measure, db, kind, top_k, rank))
