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

The figures a user reads must agree with the race that decides what is saved: the
leave-one-out run is another run (on a busy machine its times can be several times
the race's), and marginal savings of interacting rules do not add up. So the total is
taken from the race (`reconcile`): the saving of `opswap` over `captured`, with its
95% interval, as a share of the captured model's own time; and that total is divided
among the rules in proportion to their leave-one-out savings (floored at zero; evenly
when none measured one), each share with the same part of the total's interval. The
shares add up to the total, and no saving can exceed the model's time. Without a race
(`measure_rules` alone) the leave-one-out run's own `none` over `full` is the total.
Whether a rule pays is still judged by its own leave-one-out interval.

"Without the rule" is planned afresh (`planner.make_plan(exclude_rules=...)`),
not the plan with the rule's decisions deleted, so a rule whose sites depended on
the left-out one is matched on the graph as it then is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

METHOD = (
    "leave one out, scaled to the total: each rule is timed by leaving it out (the "
    "candidate planned without it against the full candidate, in one interleaved run); "
    "the total saving of all rules is {source}, and it is divided among the rules in "
    "proportion to their leave-one-out savings (floored at zero), each share with its "
    "part of the total's 95% interval, so the rules add up to the total"
)

_SOURCES = {
    "race": "the race's own (captured against opswap, in the run that picked what is saved)",
    "leave-one-out": "the leave-one-out run's (the capture with no rule against the "
    "full candidate)",
}


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
    # this rule's share of the total saving, and its part of the total's interval (ms)
    share_ms: float | None = None
    share_ci_ms: tuple[float, float] | None = None
    pruned: bool = False  # left out of the saved candidate: no share of its saving

    @property
    def loo_saved_s(self) -> float:
        """The leave-one-out difference, time(without it) - time(full), in its own run."""
        return (self.without_ms - self.with_ms) / 1e3

    @property
    def measured_saved_s(self) -> float:
        """The rule's share of the total (the leave-one-out difference before `reconcile`)."""
        return self.share_ms / 1e3 if self.share_ms is not None else self.loo_saved_s

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
        return {
            "rule": self.rule,
            "sites": self.sites,
            "predicted_saved_s": self.predicted_saved_s,
            "measured_saved_s": self.measured_saved_s,
            "measured_saved_ci_ms": list(self.share_ci_ms) if self.share_ci_ms else None,
            "loo_saved_s": self.loo_saved_s,
            "pruned": self.pruned,
            "with_ms": self.with_ms,
            "without_ms": self.without_ms,
            "ratio_quartiles": [self.ratio_q1, self.ratio_q3],
            "ratio_ci": [self.ci_low, self.ci_high],
            "pays": self.pays,
            "verdict": self.verdict,
            "device": self.device,
        }


@dataclass
class Attribution:
    """Every applied rule's leave-one-out saving, and the total, from the same run."""

    full_ms: float
    none_ms: float
    device: str
    rules: list[RuleTiming] = field(default_factory=list)
    method: str = METHOD.format(source=_SOURCES["leave-one-out"])
    note: str = ""
    none_over_full_ci: tuple[float, float] = (math.nan, math.nan)  # this run's 95% interval
    # the total all rules save (set by `reconcile`): its source, the model's own time (the
    # capture's, ms), the saving (ms) with its 95% interval, and the ratio with its interval
    source: str = "leave-one-out"
    model_ms: float | None = None
    total_ms: float | None = None
    total_ci_ms: tuple[float, float] | None = None
    ratio: float | None = None
    ratio_ci: tuple[float, float] | None = None

    @property
    def total_saved_ms(self) -> float:
        return self.total_ms if self.total_ms is not None else self.none_ms - self.full_ms

    @property
    def sum_saved_ms(self) -> float:
        return sum(t.measured_saved_s for t in self.rules if not t.pruned) * 1e3

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "source": self.source,
            "full_ms": self.full_ms,
            "none_ms": self.none_ms,
            "model_ms": self.model_ms,
            "total_saved_ms": self.total_saved_ms,
            "total_saved_ci_ms": list(self.total_ci_ms) if self.total_ci_ms else None,
            "ratio": self.ratio,
            "ratio_ci": list(self.ratio_ci) if self.ratio_ci else None,
            "sum_saved_ms": self.sum_saved_ms,
            "loo_total_saved_ms": self.none_ms - self.full_ms,
            "device": self.device,
            "note": self.note,
            "rules": [t.to_json() for t in self.rules],
        }


def reconcile(att: Attribution, race=None, pruned=()) -> Attribution:
    """Put `att` on one scale (see the module): the total from `race` (a
    bench.stats.BenchResult holding "captured" and "opswap"), or from `att`'s own run when
    the race timed not both, divided among the rules not in `pruned`. Changes `att` in
    place and returns it."""
    if race is not None and {"captured", "opswap"} <= set(race.stats):
        r = race.ratio("captured", "opswap")
        model_ms, ratio, ci, source = (
            race["captured"].median * 1e3,
            r.of_medians,
            (r.ci_low, r.ci_high),
            "race",
        )
    else:
        model_ms, source = att.none_ms, "leave-one-out"
        ratio = att.none_ms / att.full_ms if att.full_ms else math.nan
        ci = att.none_over_full_ci

    def saving(x: float) -> float:
        # time(captured) - time(opswap) at ratio x = time(captured) / time(opswap): below the
        # model's own time for every ratio, as a saving must be
        return model_ms * (1 - 1 / x) if x and math.isfinite(x) and x > 0 else math.nan

    att.source, att.model_ms, att.ratio, att.ratio_ci = source, model_ms, ratio, ci
    att.method = METHOD.format(source=_SOURCES[source])
    att.total_ms = saving(ratio)
    att.total_ci_ms = (saving(ci[0]), saving(ci[1]))
    kept = [t for t in att.rules if t.rule not in set(pruned)]
    for t in att.rules:
        t.pruned = t.rule in set(pruned)
        t.share_ms = t.share_ci_ms = None
    weights = [max(t.loo_saved_s, 0.0) for t in kept]
    if not sum(weights):
        weights = [1.0] * len(kept)
    for t, w in zip(kept, weights, strict=True):
        part = w / sum(weights)
        t.share_ms = att.total_ms * part
        t.share_ci_ms = (att.total_ci_ms[0] * part, att.total_ci_ms[1] * part)
    return att


def attribute(
    full: Callable,
    none: Callable,
    without: Mapping[str, tuple[Callable, int, float]],
    inputs: tuple,
    device="cpu",
    *,
    min_time_s: float = 0.5,
    max_time_s: float = 8.0,
    rel_width: float = 0.06,
    copy: bool = False,
) -> Attribution:
    """Time `full` (the candidate), `none` (the capture with no rule) and, per rule,
    `without[rule] = (candidate without it, its site count, its predicted saving in s)`
    in one interleaved run, in inference mode with buffers put back afterwards; on a
    noisy machine the run goes on (up to `max_time_s`) until each ratio to `full` has a
    95% interval narrower than `rel_width` of it. With `copy` (a model that writes into its
    inputs), every call runs on a fresh copy of them."""
    from opswap.bench.device import resolve_device
    from opswap.bench.timing import benchmark
    from opswap.graph.copies import preserved_state

    dev = resolve_device(device)
    from opswap.graph.inputs import caller

    fns = {"full": caller(full, inputs, copy), "none": caller(none, inputs, copy)}
    for rule, (fn, _, _) in without.items():
        fns[f"without {rule}"] = caller(fn, inputs, copy)
    mods = [full, none, *(fn for fn, _, _ in without.values())]
    with torch.inference_mode(), preserved_state(*mods):
        res = benchmark(
            fns,
            warmup=3,
            repeats=15,
            min_time_s=min_time_s,
            max_time_s=max_time_s,
            rel_width=rel_width,
            device=dev,
        )
    full_ms = res["full"].median * 1e3
    total = res.ratio("none", "full")
    out = Attribution(
        full_ms,
        res["none"].median * 1e3,
        res.device,
        none_over_full_ci=(total.ci_low, total.ci_high),
    )
    for rule, (_, sites, predicted) in without.items():
        key = f"without {rule}"
        r = res.ratio(key, "full")
        out.rules.append(
            RuleTiming(
                rule,
                sites,
                predicted,
                full_ms,
                res[key].median * 1e3,
                res.device,
                r.q1,
                r.q3,
                r.ci_low,
                r.ci_high,
            )
        )
    return reconcile(out)
