"""What each rule is worth, measured one way and stated: leave one rule out.

Method: the full candidate (every applied rule), the capture with no rule, and for
each applied rule the candidate planned again without that rule, all timed in ONE
interleaved benchmark. A rule's saving is time(candidate without it) minus
time(full candidate); the total is time(no rule) minus time(full candidate). The
savings need not add up to the total, and the report shows both: rules interact
(the Conv+ReLU fusion folds a BatchNorm itself when the fold rule is left out, so
leaving the fold out costs little while the two together save a lot). A rule pays
when the full candidate is faster than the candidate without it beyond the noise
(the 95% bootstrap interval of the ratio lies above 1); it is slower when the
interval lies below 1; otherwise it is within noise.

"Without the rule" is planned afresh (`search.plan.make_plan(exclude_rules=...)`),
not the plan with the rule's decisions deleted, so a rule whose sites depended on
the left-out one is matched on the graph as it then is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

METHOD = ("leave one out: each rule's saving is the time of the candidate planned without "
          "it minus the time of the full candidate, all variants timed in one interleaved "
          "run; savings need not add up to the total, because rules interact")


@dataclass
class RuleTiming:
    """One rule's measured worth: the full candidate against the candidate without it."""

    rule: str
    sites: int
    predicted_saved_s: float
    with_ms: float
    without_ms: float
    device: str
    ratio_q1: float | None = None  # quartiles of the per-round ratio without / with
    ratio_q3: float | None = None
    ci_low: float | None = None  # 95% bootstrap interval of without / with
    ci_high: float | None = None

    @property
    def measured_saved_s(self) -> float:
        return (self.without_ms - self.with_ms) / 1e3

    def _ci(self) -> tuple[float, float] | None:
        if self.ci_low is None or self.ci_high is None or math.isnan(self.ci_low):
            return None
        return self.ci_low, self.ci_high

    @property
    def pays(self) -> bool:
        """The full candidate is faster than the one without this rule, beyond the noise."""
        ci = self._ci()
        return ci is not None and ci[0] > 1.0

    @property
    def slower(self) -> bool:
        """The candidate is faster without this rule, beyond the noise: prune it."""
        ci = self._ci()
        return ci is not None and ci[1] < 1.0

    @property
    def verdict(self) -> str:
        return "pays" if self.pays else "slower" if self.slower else "within noise"

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "sites": self.sites,
                "predicted_saved_s": self.predicted_saved_s,
                "measured_saved_s": self.measured_saved_s, "with_ms": self.with_ms,
                "without_ms": self.without_ms,
                "ratio_quartiles": [self.ratio_q1, self.ratio_q3],
                "ratio_ci": [self.ci_low, self.ci_high], "pays": self.pays,
                "verdict": self.verdict, "device": self.device}


@dataclass
class Attribution:
    """Every applied rule's leave-one-out saving, and the total, from the same run."""

    full_ms: float
    none_ms: float
    device: str
    rules: list[RuleTiming] = field(default_factory=list)
    method: str = METHOD
    note: str = ""

    @property
    def total_saved_ms(self) -> float:
        return self.none_ms - self.full_ms

    @property
    def sum_saved_ms(self) -> float:
        return sum(t.measured_saved_s for t in self.rules) * 1e3

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "full_ms": self.full_ms, "none_ms": self.none_ms,
                "total_saved_ms": self.total_saved_ms, "sum_saved_ms": self.sum_saved_ms,
                "device": self.device, "note": self.note,
                "rules": [t.to_json() for t in self.rules]}


def attribute(full: Callable, none: Callable, without: dict[str, tuple[Callable, int, float]],
              inputs: tuple, device="cpu", *, min_time_s: float = 0.5, max_time_s: float = 8.0,
              rel_width: float = 0.06) -> Attribution:
    """Time `full` (the candidate), `none` (the capture with no rule) and, per rule,
    `without[rule] = (candidate without it, its site count, its predicted saving in s)`
    in one interleaved run, in inference mode with buffers put back afterwards; on a
    noisy machine the run goes on (up to `max_time_s`) until each ratio to `full` has a
    95% interval narrower than `rel_width` of it."""
    from opswap.bench.timing import benchmark, resolve_device
    from opswap.graph.copies import preserved_state

    dev = resolve_device(device)
    fns = {"full": lambda: full(*inputs), "none": lambda: none(*inputs)}
    for rule, (fn, _, _) in without.items():
        fns[f"without {rule}"] = lambda f=fn: f(*inputs)
    mods = [full, none, *(fn for fn, _, _ in without.values())]
    with torch.inference_mode(), preserved_state(*mods):
        res = benchmark(fns, warmup=3, repeats=15, min_time_s=min_time_s, max_time_s=max_time_s,
                        rel_width=rel_width, device=dev)
    full_ms = res["full"].median * 1e3
    out = Attribution(full_ms, res["none"].median * 1e3, res.device)
    for rule, (_, sites, predicted) in without.items():
        key = f"without {rule}"
        r = res.ratio(key, "full")
        out.rules.append(RuleTiming(rule, sites, predicted, full_ms, res[key].median * 1e3,
                                    res.device, r.q1, r.q3, r.ci_low, r.ci_high))
    return out
