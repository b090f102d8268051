"""Leave-one-out attribution: one run, one stated method, the sum beside the total, and a
rule pays only beyond the noise. Bootstrap intervals. Dependent sites planned afresh."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from torch import nn

from opswap.bench.attribution import METHOD, RuleTiming, attribute
from opswap.bench.timing import bootstrap_ratio
from opswap.config import OptimizeConfig
from opswap.pipeline import optimize


def test_bootstrap_interval_brackets_a_real_ratio_and_holds_one_for_noise():
    rng = random.Random(1)
    slow = [2.0 + rng.gauss(0, 0.05) for _ in range(40)]
    fast = [1.0 + rng.gauss(0, 0.05) for _ in range(40)]
    lo, hi = bootstrap_ratio(slow, fast)
    assert 1.8 < lo < 2.0 < hi < 2.2
    same = [1.0 + rng.gauss(0, 0.05) for _ in range(40)]
    lo, hi = bootstrap_ratio(same, fast)
    assert lo <= 1.0 <= hi
    assert bootstrap_ratio(slow, fast) == bootstrap_ratio(slow, fast)  # seeded
    assert all(math.isnan(v) for v in bootstrap_ratio([1.0, 2.0], [1.0, 1.0]))  # too few


def _timing(lo, hi):
    return RuleTiming("r", 1, 0.0, 1.0, 1.1, "cpu", ci_low=lo, ci_high=hi)


def test_a_rule_pays_only_beyond_the_noise():
    assert _timing(1.02, 1.2).verdict == "pays"
    assert _timing(0.98, 1.2).verdict == "within noise"
    assert not _timing(0.98, 1.2).pays and not _timing(0.98, 1.2).slower
    assert _timing(0.8, 0.97).verdict == "slower"
    assert _timing(float("nan"), float("nan")).verdict == "within noise"


class Small(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(16, width)

    def forward(self, x):
        return self.fc(x).sum(-1)


def test_attribution_times_everything_in_one_run_against_one_full_candidate():
    x = (torch.randn(4, 16),)
    full, none = Small(8), Small(64)
    without = {"a": (Small(32), 3, 1e-6), "b": (Small(16), 1, 0.0)}
    att = attribute(full, none, without, x, min_time_s=0.05)
    assert att.method.startswith(METHOD.split("{")[0]) and "leave one out" in att.method
    assert [t.rule for t in att.rules] == ["a", "b"]
    assert {t.with_ms for t in att.rules} == {att.full_ms}  # the same full candidate
    # without a race, the total is this run's own, and the rules' shares add up to it
    assert att.total_saved_ms == pytest.approx(att.none_ms - att.full_ms)
    assert att.sum_saved_ms == pytest.approx(att.total_saved_ms)
    loo = [max(t.without_ms - t.with_ms, 0.0) for t in att.rules]
    if sum(loo):  # in proportion to the leave-one-out savings
        assert [t.measured_saved_s * 1e3 for t in att.rules] == pytest.approx(
            [att.total_saved_ms * x / sum(loo) for x in loo]
        )
    assert att.rules[0].sites == 3 and att.rules[0].predicted_saved_s == 1e-6
    j = att.to_json()
    assert {"method", "total_saved_ms", "sum_saved_ms", "rules"} <= set(j)
    assert all(len(r["ratio_ci"]) == 2 and r["verdict"] for r in j["rules"])


class ConvBNReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


def _model():
    torch.manual_seed(0)
    m = ConvBNReLU().eval()
    for b in (m.b1, m.b2):
        b.running_mean.uniform_(-1, 1)
        b.running_var.uniform_(0.5, 2)
        b.weight.data.uniform_(0.5, 2)
    return m


def test_sites_that_depended_on_a_rolled_back_one_are_planned_afresh():
    # a budget no fold can meet: every BatchNorm fold is rolled back, and the Conv+ReLU
    # fusions planned on the folded graph must be matched again, not lost as "not found"
    r = optimize(
        _model(),
        (torch.randn(2, 3, 10, 10),),
        OptimizeConfig(budget="max_abs<=0", samples=1, bench=False, layers=False),
    )
    assert r.verification.passed
    assert not [f for f in r.failed if "not found" in f.reason]
    rolled = {(x.decision.rule, x.decision.site.key) for x in r.rolled_back}
    assert ("fusion.conv_bn", "c1+b1") in rolled
    # conv_relu was planned again on the unfolded graph (its own site, its own verdict)
    assert any(rule == "fusion.conv_relu" for rule, _ in rolled)
    assert {s.key for s in r.applied} == {d.site.key for d in r.plan.decisions}


def test_run_settings_are_recorded():
    r = optimize(
        _model(),
        (torch.randn(2, 3, 10, 10),),
        OptimizeConfig(samples=1, bench=False, layers=False),
        model_settings={"batch": 2, "attn_implementation": "eager"},
    )
    run = r.to_json()["run"]
    assert run["inputs"] == [{"name": "x", "shape": [2, 3, 10, 10], "dtype": "float32"}]
    assert run["threads"] == torch.get_num_threads() and run["device"]
    assert run["model_settings"]["batch"] == 2 and run["attn_implementation"] == "eager"


def test_rules_and_race_agree_on_a_machine_busier_in_one_run_than_the_other(monkeypatch):
    from opswap.bench import timing
    from opswap.bench.noisy import busy
    from opswap.report.document import Table
    from opswap.report.optimize_report import build_report

    # the leave-one-out run sees 5x the load the race sees (a neighbour that then left), and
    # every sample has its jitter: the figures must still agree with the race
    monkeypatch.setattr(
        timing, "_Timer", busy(seed=4, load=(5.0, 1.0), jitter=((0.8, 1.0), (0.2, 3.0)))
    )
    r = optimize(
        _model(),
        (torch.randn(2, 3, 10, 10),),
        OptimizeConfig(samples=1, layers=False, compare="none", prune_slow=False),
    )
    assert r.rule_timings
    timed = {v.name: v for v in r.variants}
    model_ms, saved = timed["captured"].ms, timed["captured"].ms - timed["opswap"].ms
    j = r.to_json()["attribution"]
    assert j["total_saved_ms"] == pytest.approx(saved, rel=1e-9, abs=1e-12)
    assert j["sum_saved_ms"] == pytest.approx(saved, rel=1e-9, abs=1e-12)
    lo, hi = j["total_saved_ci_ms"]
    assert lo <= j["sum_saved_ms"] <= hi and lo <= j["total_saved_ms"] <= hi
    assert hi < model_ms
    for row in j["rules"]:
        s_lo, s_hi = row["measured_saved_ci_ms"]
        assert s_lo <= row["measured_saved_s"] * 1e3 <= s_hi < model_ms
    # the report's table: every row carries its interval
    (table,) = [
        b
        for b in build_report(r)
        if isinstance(b, Table) and any(h.startswith("measured saving") for h in b.headers)
    ]
    col = next(i for i, h in enumerate(table.headers) if h.startswith("measured saving"))
    assert len(table.rows) == len(r.rule_timings) + 2
    assert all(re.search(r"\[-?[\d.]+--?[\d.]+\]", row[col]) for row in table.rows), table.rows
