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

No function here asserts anything about speed: tests check structure, not clocks.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import gc
import math
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.errors import OpswapError

UNSETTLED = "timings did not settle: the machine is busy"


def narrow(lo: float, hi: float, mid: float, rel_width: float) -> bool:
    """Whether the interval [lo, hi] of the ratio `mid` is narrower than `rel_width` of it."""
    return math.isfinite(lo) and math.isfinite(hi) and (hi - lo) <= rel_width * abs(mid)


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


@dataclass
class Stats:
    """Seconds per call of one candidate: one sample per round."""

    name: str
    samples: list[float]
    inner: int  # calls per sample

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def median_s(self) -> float:
        return self.median

    @property
    def median_ms(self) -> float:
        return self.median * 1e3

    @property
    def q1(self) -> float:
        return _quartiles(self.samples)[0]

    @property
    def q3(self) -> float:
        return _quartiles(self.samples)[1]

    @property
    def iqr(self) -> float:
        q1, q3 = _quartiles(self.samples)
        return q3 - q1

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "median_ms": self.median * 1e3, "iqr_ms": self.iqr * 1e3,
                "min_ms": self.min * 1e3, "mean_ms": self.mean * 1e3, "n": self.n,
                "inner": self.inner}


def bootstrap_ratio(a: list[float], b: list[float], *, level: float = 0.95,
                    resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """Interval of median(a) / median(b) over paired samples (round i gives a[i] and b[i]),
    by resampling the rounds with replacement; seeded, so a run's report is reproducible."""
    import random

    n = len(a)
    if n < 3:
        return math.nan, math.nan
    rng = random.Random(seed)
    picks = range(n)
    ratios = []
    for _ in range(resamples):
        idx = rng.choices(picks, k=n)
        mb = statistics.median(b[i] for i in idx)
        if mb > 0:
            ratios.append(statistics.median(a[i] for i in idx) / mb)
    if not ratios:
        return math.nan, math.nan
    ratios.sort()
    lo = ratios[int((1 - level) / 2 * (len(ratios) - 1))]
    hi = ratios[int((1 + level) / 2 * (len(ratios) - 1))]
    return lo, hi


@dataclass(frozen=True)
class Ratio:
    """time(a) / time(b): the median of per-round ratios, the ratio of medians (the figure
    that agrees with the medians printed beside it) and its 95% bootstrap interval."""

    paired: float
    of_medians: float
    q1: float  # quartiles of the per-round ratios
    q3: float
    n: int
    ci_low: float = math.nan
    ci_high: float = math.nan

    @property
    def spread(self) -> float:
        return self.q3 - self.q1

    @property
    def within_noise(self) -> bool:
        """True when the interval holds 1.0 (or there is none): no speed-up or slow-down
        can be claimed."""
        return not (self.ci_low > 1.0 or self.ci_high < 1.0)

    def describe(self) -> str:
        """'1.42x [1.37-1.48]', with ', within noise' when the interval holds 1.0."""
        if math.isnan(self.ci_low):
            return f"{self.of_medians:.2f}x"
        text = f"{self.of_medians:.2f}x [{self.ci_low:.2f}-{self.ci_high:.2f}]"
        return text + (", within noise" if self.within_noise else "")


@dataclass
class BenchResult:
    stats: dict[str, Stats]
    rounds: list[dict[str, float]]  # per round: seconds per call of each candidate
    order: list[list[str]]  # per round: the order the candidates ran in
    device: str
    warmup: int
    # with `rel_width`: whether every interval narrowed to it before time ran out
    settled: bool | None = None
    rel_width: float | None = None

    def __getitem__(self, name: str) -> Stats:
        return self.stats[name]

    def ratio(self, a: str, b: str) -> Ratio:
        """How many times longer `a` takes than `b` (the speed-up of b over a)."""
        per_round = [r[a] / r[b] for r in self.rounds if r[b] > 0]
        if not per_round:
            nan = math.nan
            return Ratio(nan, nan, nan, nan, 0)
        q1, q3 = _quartiles(per_round)
        pairs = [(r[a], r[b]) for r in self.rounds if r[b] > 0]
        lo, hi = bootstrap_ratio([x for x, _ in pairs], [y for _, y in pairs])
        return Ratio(statistics.median(per_round), self.stats[a].median / self.stats[b].median,
                     q1, q3, len(per_round), lo, hi)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "warmup": self.warmup, "rounds": len(self.rounds),
                "settled": self.settled, "rel_width": self.rel_width,
                "stats": {k: s.to_json() for k, s in self.stats.items()}}


# --------------------------------------------------------------------------- devices


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def resolve_device(device) -> torch.device:
    """A torch.device from 'cpu', 'cuda', 'cuda:1' or a device; errors in words."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise OpswapError(f"Unknown device {device!r}; use cpu or cuda.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OpswapError("CUDA was asked for but torch sees no GPU; time on --device cpu.")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise OpswapError(f"Timing on {dev.type!r} is not supported; use cpu or cuda.")
    return dev


def check_device(device: str) -> None:
    """Refuse, in one sentence, a device name opswap cannot run on (cpu, cuda or cuda:N),
    and CUDA on a machine without a GPU, before any work."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise OpswapError(f"Unknown device {device!r}; use cpu, cuda or cuda:N.")
    resolve_device(device)


def describe_device(device) -> str:
    """'cpu: <model>, N threads' or 'cuda: <GPU name>'."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    n = torch.get_num_threads()
    return f"cpu: {_cpu_name()}, {n} thread{'s' if n != 1 else ''}"


# --------------------------------------------------------------------------- the timer


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
    dev = resolve_device(device)
    timer = _Timer(dev)
    names = list(fns)
    k = len(names)

    def rotated(r: int) -> list[str]:
        return names[r % k:] + names[:r % k]

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
                if r >= repeats and elapsed >= min_time_s and (
                        rel_width is None or r % _CHECK_EVERY == 0 and _narrow(rounds, names, rel_width)):
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

    if settled is False and len(rounds) >= 3:
        settled = _narrow(rounds, names, rel_width)  # the last rounds may have narrowed it
    stats = {n: Stats(n, [rd[n] for rd in rounds], inner[n]) for n in names}
    return BenchResult(stats, rounds, order, describe_device(dev), warmup, settled, rel_width)


# --------------------------------------------------------------------------- models


@dataclass
class ModelBench:
    """Reference and candidate model timed in the same run; `speedup` = ref / opt."""

    ref_ms: float
    opt_ms: float
    speedup: float  # median of per-round ref/opt ratios
    speedup_of_medians: float
    spread: float  # interquartile range of the per-round speed-ups
    ref_iqr_ms: float
    opt_iqr_ms: float
    rounds: int
    device: str
    torch: str = torch.__version__
    ref_peak_bytes: int | None = None
    opt_peak_bytes: int | None = None
    date: str = field(
        default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    notes: list[str] = field(default_factory=list)
    speedup_q1: float | None = None  # quartiles of the per-round speed-ups: the noise
    speedup_q3: float | None = None
    speedup_ci: tuple[float, float] | None = None  # 95% bootstrap of speedup_of_medians
    settled: bool | None = None  # the interval narrowed to rel_width before time ran out
    rel_width: float | None = None

    @property
    def within_noise(self) -> bool:
        return self.speedup_ci is None or not (self.speedup_ci[0] > 1.0
                                               or self.speedup_ci[1] < 1.0)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "speedup_q1", "speedup_q3", "speedup_ci", "within_noise", "settled", "rel_width",
            "ref_ms", "opt_ms", "speedup", "speedup_of_medians", "spread", "ref_iqr_ms",
            "opt_iqr_ms", "rounds", "device", "torch", "ref_peak_bytes", "opt_peak_bytes",
            "date", "notes")}

    def __str__(self) -> str:
        text = (f"{self.ref_ms:.3f} ms -> {self.opt_ms:.3f} ms, speedup "
                f"{describe_speedup(self.speedup_of_medians, self.speedup_ci, self.settled)} "
                f"({self.rounds} rounds) on {self.device}")
        return text + (f"; {UNSETTLED}" if self.settled is False else "")


def describe_speedup(ratio: float | None, ci, settled: bool | None = True) -> str:
    """'1.42x [1.37-1.48]', with ', within noise' when the interval holds 1.0. When the
    interval did not narrow (`settled` False), the lower end leads, the median follows:
    'at least 1.07x [1.07-38.37], median 14.48x'."""
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return "-"
    if not ci or ci[0] is None or ci[1] is None or math.isnan(ci[0]):
        return f"{ratio:.2f}x"
    lo, hi = ci
    noise = ", within noise" if lo <= 1.0 <= hi else ""
    if settled is False:
        lead = f"at least {lo:.2f}x" if lo > 1.0 else f"{lo:.2f}x"
        return f"{lead} [{lo:.2f}-{hi:.2f}]{noise}, median {ratio:.2f}x"
    return f"{ratio:.2f}x [{lo:.2f}-{hi:.2f}]{noise}"


def _first_device(model) -> torch.device | None:
    if isinstance(model, nn.Module):
        for t in list(model.parameters()) + list(model.buffers()):
            return t.device
    return None


def _on(model, dev: torch.device, notes: list[str], label: str):
    """`model` on `dev`: itself if already there, else a moved copy (the user's model is
    never touched)."""
    where = _first_device(model)
    if where is None or where == dev:
        return model
    try:
        moved = copy.deepcopy(model).to(dev)
    except Exception as e:
        raise OpswapError(f"Could not move the {label} model to {dev} ({type(e).__name__}: "
                          f"{str(e).strip()[:200]}); move it yourself before timing.") from e
    notes.append(f"the {label} model was copied from {where} to {dev} for timing")
    return moved


def bench_models(
    reference: Callable,
    candidate: Callable,
    inputs,
    device=None,
    *,
    warmup: int = 5,
    repeats: int = 20,
    min_time_s: float = 0.5,
    max_time_s: float = 8.0,
    rel_width: float | None = 0.1,
    memory: bool = True,
) -> ModelBench:
    """Time `reference(*inputs)` against `candidate(*inputs)` in eval and inference mode,
    until the speed-up's 95% interval is narrower than `rel_width` of it or `max_time_s`
    passed (then the result says it did not settle).

    `device` defaults to where the inputs are. Inputs are moved there; a model that is
    elsewhere is timed as a moved copy. With `memory`, each model's peak memory over one
    call is measured too (after the timing, so it does not disturb it).
    """
    from opswap.bench.memory import peak_memory
    from opswap.graph.copies import preserved_state
    from opswap.graph.inputs import caller, fresh, writes
    from opswap.verify.outputs import eval_mode

    args = inputs if isinstance(inputs, tuple) else (
        tuple(inputs) if isinstance(inputs, list) else (inputs,))
    if device is None:
        tensors = [x for x in pytree.tree_leaves(list(args)) if isinstance(x, torch.Tensor)]
        first = tensors[0] if tensors else None
        device = first.device if first is not None else "cpu"
    dev = resolve_device(device)
    # a private copy: on the same device .to() hands back the caller's own tensors
    args = fresh(tuple(pytree.tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor)
                                       else x, list(args))))
    notes: list[str] = []
    ref, cand = _on(reference, dev, notes, "reference"), _on(candidate, dev, notes, "candidate")
    # (version counters of tensors made outside inference mode count its writes too)
    with torch.inference_mode(), eval_mode(ref), preserved_state(ref):
        copy = bool(writes(lambda xs: ref(*xs), args))  # then every call gets a fresh copy
    if copy:
        notes.append("the model writes into its inputs: each call ran on a fresh copy of them")

    with torch.inference_mode(), eval_mode(ref, cand), preserved_state(ref, cand):
        res = benchmark({"reference": caller(ref, args, copy),
                         "candidate": caller(cand, args, copy)},
                        warmup=warmup, repeats=repeats, min_time_s=min_time_s,
                        max_time_s=max_time_s, rel_width=rel_width, device=dev)
        ref_peak = opt_peak = None
        if memory:
            try:
                ref_peak = peak_memory(caller(ref, args, copy), device=dev).peak_bytes
                opt_peak = peak_memory(caller(cand, args, copy), device=dev).peak_bytes
            except Exception as e:  # memory is a bonus; the timing stands without it
                notes.append(f"peak memory not measured: {type(e).__name__}: {str(e)[:120]}")
    r = res.ratio("reference", "candidate")
    s_ref, s_opt = res["reference"], res["candidate"]
    return ModelBench(
        ref_ms=s_ref.median * 1e3, opt_ms=s_opt.median * 1e3, speedup=r.paired,
        speedup_of_medians=r.of_medians, spread=r.spread, speedup_q1=r.q1, speedup_q3=r.q3,
        speedup_ci=(r.ci_low, r.ci_high),
        ref_iqr_ms=s_ref.iqr * 1e3,
        opt_iqr_ms=s_opt.iqr * 1e3, rounds=len(res.rounds), device=res.device,
        ref_peak_bytes=ref_peak, opt_peak_bytes=opt_peak, notes=notes,
        settled=res.settled, rel_width=rel_width,
    )
