"""Calibration observers: the range of values an int8 tensor must cover, chosen from what
the tensor held over sample inputs, and the scale and zero point that range gives.

An observer sees one tensor (a layer's input) over several calibration batches in two
passes: the first records the smallest and largest value, the second a histogram of the
values (`BINS` bins over [min, max]) and one of their magnitudes (over [0, max |x|]).
`choose(method)` then picks the range to quantise to:

- `minmax`: the observed [min, max]. Nothing is clipped; one outlier stretches the step
  for every other value.
- `percentile`: the `percentile`-th value from each end (99.99 by default): the rare
  outliers are clipped to keep the step fine for the bulk.
- `mse`: of 100 clipping ranges from 5% to 100% of the observed one, the one whose
  quantisation of the histogram has the least mean squared error (rounding of the values
  inside plus clipping of those outside), computed from the bin centres.
- `entropy`: TensorRT's calibration: of thresholds t over the magnitude histogram, the
  one whose 128-level quantisation of the clipped distribution has the least KL
  divergence from it; the range is [-t, t] cut to the observed one. Thresholds that
  would clip more than 1% of the values are not tried: on a distribution held in a few
  bins far from zero (a pooled feature map plus an offset) the divergence is smallest
  for a threshold below all of it, which clips every value to one (a test's model lost
  30% of its output that way).

Activations are quantised per tensor to `uint8` with a zero point (onednn's int8 kernels
take unsigned activations): asymmetric ranges use all 256 steps over [lo, hi];
symmetric ones use zero point 128 and the step max(|lo|, |hi|) / 127, which leaves the
top step unused, so the values stay within [-127, 127] around zero, as int8 would hold
them. Either way the range is widened to hold 0 exactly, so zero padding and ReLU's
zeros are represented without error.

Why our own rather than torchao's observers: these work on any tensor of the captured
graph, outside torchao's PT2E flow (which wants the whole model exported, prepared and
compiled), each choice is a few lines that the chapter explains, and the histogram is
shared by all four methods, so comparing them costs one calibration run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

METHODS = ("minmax", "percentile", "mse", "entropy")
BINS = 2048
QMIN, QMAX = 0, 255  # uint8 activations


@dataclass(frozen=True)
class QParams:
    """A per-tensor affine quantisation: q = clamp(round(x / scale) + zero_point, 0, 255)."""

    scale: float
    zero_point: int

    def to_json(self) -> dict[str, float | int]:
        return {"scale": self.scale, "zero_point": self.zero_point}


def qparams(lo: float, hi: float, symmetric: bool) -> QParams:
    """Scale and zero point of a uint8 quantisation covering [lo, hi] (widened to hold 0)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"cannot quantise the range [{lo}, {hi}]: it is not finite")
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if symmetric:
        amax = max(-lo, hi)
        return QParams(max(amax / 127.0, 1e-12), 128)
    scale = max((hi - lo) / (QMAX - QMIN), 1e-12)
    zero_point = int(min(max(round(-lo / scale), QMIN), QMAX))
    return QParams(scale, zero_point)


class Observer:
    """The distribution of one tensor over calibration batches (see the module's notes)."""

    def __init__(self, bins: int = BINS):
        self.bins = bins
        self.lo = math.inf
        self.hi = -math.inf
        self.count = 0
        self.hist: torch.Tensor | None = None  # over [lo, hi]
        self.abs_hist: torch.Tensor | None = None  # over [0, max(|lo|, |hi|)]
        self.nonfinite = 0

    @property
    def amax(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    def observe_range(self, x: torch.Tensor) -> None:
        """Pass 1: the extremes (non-finite values are counted and left out)."""
        x = x.detach().float()
        finite = x[torch.isfinite(x)] if not bool(torch.isfinite(x).all()) else x
        self.nonfinite += x.numel() - finite.numel()
        if finite.numel():
            self.lo = min(self.lo, float(finite.min()))
            self.hi = max(self.hi, float(finite.max()))
            self.count += finite.numel()

    def observe_values(self, x: torch.Tensor) -> None:
        """Pass 2: the histograms over the range pass 1 found."""
        if self.count == 0:
            return
        x = x.detach().float().flatten()
        x = x[torch.isfinite(x)]
        lo, hi = self.lo, self.hi if self.hi > self.lo else self.lo + 1e-12
        h = torch.histc(x, self.bins, lo, hi)
        a = torch.histc(x.abs(), self.bins, 0.0, max(self.amax, 1e-12))
        self.hist = h if self.hist is None else self.hist + h
        self.abs_hist = a if self.abs_hist is None else self.abs_hist + a

    def choose(
        self, method: str, symmetric: bool, percentile: float = 99.99
    ) -> tuple[float, float]:
        """The range [lo, hi] to quantise to, by `method` (one of METHODS)."""
        if self.count == 0:
            raise ValueError("the observer saw no finite value: run calibration first")
        if method == "minmax" or self.hi <= self.lo or self.hist is None:
            return (-self.amax, self.amax) if symmetric else (self.lo, self.hi)
        if method == "percentile":
            return self._percentile(percentile, symmetric)
        if method == "mse":
            return self._mse(symmetric)
        if method == "entropy":
            t = self._entropy()
            return (max(self.lo, -t), min(self.hi, t)) if not symmetric else (-t, t)
        raise ValueError(f"unknown calibration method {method!r}; use one of {', '.join(METHODS)}")

    def qparams(self, method: str, symmetric: bool, percentile: float = 99.99) -> QParams:
        lo, hi = self.choose(method, symmetric, percentile)
        return qparams(lo, hi, symmetric)

    # the methods, each over the histograms

    def _edges(self, lo: float, hi: float) -> torch.Tensor:
        return torch.linspace(lo, hi, self.bins + 1, dtype=torch.float64)

    def _quantile(self, hist: torch.Tensor, lo: float, hi: float, q: float) -> float:
        cdf = torch.cumsum(hist.double(), 0) / hist.sum().double()
        i = int(torch.searchsorted(cdf, torch.tensor(q, dtype=torch.float64)))
        i = min(i, self.bins - 1)
        return float(self._edges(lo, hi)[i + 1])

    def _percentile(self, p: float, symmetric: bool) -> tuple[float, float]:
        q = p / 100.0
        if symmetric:
            assert self.abs_hist is not None
            t = self._quantile(self.abs_hist, 0.0, self.amax, q)
            return -t, t
        assert self.hist is not None
        hi = self._quantile(self.hist, self.lo, self.hi, q)
        lo = self._quantile(self.hist, self.lo, self.hi, 1.0 - q)
        return lo, hi

    def _mse(self, symmetric: bool) -> tuple[float, float]:
        assert self.hist is not None and self.abs_hist is not None
        if symmetric:
            centres = (self._edges(0.0, self.amax)[:-1] + self._edges(0.0, self.amax)[1:]) / 2
            weights = self.abs_hist.double()
        else:
            edges = self._edges(self.lo, self.hi)
            centres = (edges[:-1] + edges[1:]) / 2
            weights = self.hist.double()
        fractions = torch.linspace(0.05, 1.0, 100, dtype=torch.float64)
        best, best_err = (self.lo, self.hi), math.inf
        for f in fractions.tolist():
            lo, hi = (-self.amax * f, self.amax * f) if symmetric else (self.lo * f, self.hi * f)
            p = qparams(lo, hi, symmetric)
            q = torch.clamp(torch.round(centres / p.scale) + p.zero_point, QMIN, QMAX)
            err = float((weights * (centres - (q - p.zero_point) * p.scale) ** 2).sum())
            if err < best_err:
                best, best_err = (lo, hi), err
        return best

    def _entropy(self, levels: int = 128, stride: int = 8) -> float:
        assert self.abs_hist is not None
        hist = self.abs_hist.double()
        width = self.amax / self.bins
        best_t, best_kl = self.amax, math.inf
        cdf = torch.cumsum(hist, 0) / hist.sum()
        start = max(
            levels, int(torch.searchsorted(cdf, torch.tensor(0.99, dtype=torch.float64))) + 1
        )
        for i in range(start, self.bins + 1, stride):
            p = hist[:i].clone()
            p[-1] += hist[i:].sum()  # what lies beyond the threshold is clipped onto it
            # quantise the first i bins into `levels` groups, spreading each group's mass
            # evenly over its nonzero bins
            groups = torch.arange(i) * levels // i
            nonzero = (hist[:i] > 0).double()
            mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, groups, hist[:i])
            support = torch.zeros(levels, dtype=torch.float64).index_add_(0, groups, nonzero)
            q = torch.where(nonzero > 0, (mass / support.clamp_min(1))[groups], 0.0)
            ps, qs = p.sum(), q.sum()
            if ps <= 0 or qs <= 0:
                continue
            p, q = p / ps, q / qs
            keep = p > 0
            kl = float((p[keep] * torch.log(p[keep] / q[keep].clamp_min(1e-12))).sum())
            if kl < best_kl:
                best_t, best_kl = (i + 0.5) * width, kl
        return min(best_t, self.amax)
