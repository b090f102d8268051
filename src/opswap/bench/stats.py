"""The statistics of a timing run: per-candidate samples, paired ratios, their intervals.

A ratio is read from rounds taken side by side (bench.timing interleaves them): the median
of per-round ratios cancels drift slower than a round, and a 95% bootstrap interval over
the rounds says whether a speed-up can be claimed at all. `ModelBench` holds the
reference-against-candidate figures that `bench_models` reports.
"""

from __future__ import annotations

import datetime as _dt
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

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
        return {
            "name": self.name,
            "median_ms": self.median * 1e3,
            "iqr_ms": self.iqr * 1e3,
            "min_ms": self.min * 1e3,
            "mean_ms": self.mean * 1e3,
            "n": self.n,
            "inner": self.inner,
        }


def bootstrap_ratio(
    a: list[float], b: list[float], *, level: float = 0.95, resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
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
        return Ratio(
            statistics.median(per_round),
            self.stats[a].median / self.stats[b].median,
            q1,
            q3,
            len(per_round),
            lo,
            hi,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "warmup": self.warmup,
            "rounds": len(self.rounds),
            "settled": self.settled,
            "rel_width": self.rel_width,
            "stats": {k: s.to_json() for k, s in self.stats.items()},
        }


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
        default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    )
    notes: list[str] = field(default_factory=list)
    speedup_q1: float | None = None  # quartiles of the per-round speed-ups: the noise
    speedup_q3: float | None = None
    speedup_ci: tuple[float, float] | None = None  # 95% bootstrap of speedup_of_medians
    settled: bool | None = None  # the interval narrowed to rel_width before time ran out
    rel_width: float | None = None

    @classmethod
    def of(
        cls,
        res: BenchResult,
        ref: str,
        opt: str,
        *,
        ref_peak: int | None = None,
        opt_peak: int | None = None,
        notes: list[str] | None = None,
        settled: bool | None = None,
        rel_width: float | None = None,
    ) -> ModelBench:
        """The figures of `opt` against `ref` from one interleaved run `res`."""
        r = res.ratio(ref, opt)
        a, b = res[ref], res[opt]
        return cls(
            ref_ms=a.median * 1e3,
            opt_ms=b.median * 1e3,
            speedup=r.paired,
            speedup_of_medians=r.of_medians,
            spread=r.spread,
            speedup_q1=r.q1,
            speedup_q3=r.q3,
            speedup_ci=(r.ci_low, r.ci_high),
            ref_iqr_ms=a.iqr * 1e3,
            opt_iqr_ms=b.iqr * 1e3,
            rounds=len(res.rounds),
            device=res.device,
            ref_peak_bytes=ref_peak,
            opt_peak_bytes=opt_peak,
            notes=notes if notes is not None else [],
            settled=settled,
            rel_width=rel_width,
        )

    @property
    def within_noise(self) -> bool:
        return self.speedup_ci is None or not (self.speedup_ci[0] > 1.0 or self.speedup_ci[1] < 1.0)

    def to_json(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in (
                "speedup_q1",
                "speedup_q3",
                "speedup_ci",
                "within_noise",
                "settled",
                "rel_width",
                "ref_ms",
                "opt_ms",
                "speedup",
                "speedup_of_medians",
                "spread",
                "ref_iqr_ms",
                "opt_iqr_ms",
                "rounds",
                "device",
                "torch",
                "ref_peak_bytes",
                "opt_peak_bytes",
                "date",
                "notes",
            )
        }

    def __str__(self) -> str:
        text = (
            f"{self.ref_ms:.3f} ms -> {self.opt_ms:.3f} ms, speedup "
            f"{describe_speedup(self.speedup_of_medians, self.speedup_ci, self.settled)} "
            f"({self.rounds} rounds) on {self.device}"
        )
        return text + (f"; {UNSETTLED}" if self.settled is False else "")


def describe_speedup(ratio: float | None, ci, settled: bool | None = True) -> str:
    """'1.42x [1.37-1.48]', with ', within noise' when the interval holds 1.0. When the
    interval did not narrow (`settled` False), the end it supports leads and the median
    follows: 'at least 1.07x [1.07-38.37], median 14.48x', 'at most 0.93x [0.41-0.93],
    median 0.70x', 'within noise [0.80-2.69], median 1.40x'."""
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return "-"
    if not ci or ci[0] is None or ci[1] is None or math.isnan(ci[0]):
        return f"{ratio:.2f}x"
    lo, hi = ci
    noise = lo <= 1.0 <= hi
    if settled is False:
        # the figure read first is the one the interval supports: its lower end for a
        # faster time, its upper end for a slower one, and "within noise" otherwise
        lead = (
            "within noise" if noise else f"at least {lo:.2f}x" if lo > 1.0 else f"at most {hi:.2f}x"
        )
        return f"{lead} [{lo:.2f}-{hi:.2f}], median {ratio:.2f}x"
    return f"{ratio:.2f}x [{lo:.2f}-{hi:.2f}]" + (", within noise" if noise else "")
