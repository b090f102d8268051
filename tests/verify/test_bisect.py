import math
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import opswap.verify.bisect as bisect_mod
from opswap.errors import VerificationError
from opswap.graph.capture import capture
from opswap.graph.ops import op_kind
from opswap.planner import Decision, Plan, PlanSettings
from opswap.rules import registry
from opswap.rules.base import Found, Rule, Site
from opswap.verify.bisect import find_culprit, rollback


class _ConvRule(Rule):
    """Test-only: one site per conv node, keyed by the node's name."""

    family = "test"
    chapter = 23
    exactness = "exact"
    factor: ClassVar[float] = 1.0

    anchors = ("conv",)

    def check(self, gm, n):
        return Found((n,), f"conv {n.target}")

    def rewrite(self, gm, found):
        conv = gm.get_submodule(found.nodes[0].target)
        with torch.no_grad():
            conv.weight.copy_(conv.weight * self.factor)


class Noop(_ConvRule):
    name = "test.noop"  # claims exact and is


class Scale(_ConvRule):
    name = "test.scale"  # claims exact and is not: must be found and rolled back
    factor = 1.01


@pytest.fixture
def fake_rules(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", True)  # keep the real rule families out of it
    for cls in (Noop, Scale):
        registry.register(cls)
    yield
    for cls in (Noop, Scale):
        registry._RULES.pop(cls.name, None)


class Stack(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.first = nn.Conv2d(3, 6, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(6, 6, 3, padding=1) for _ in range(n - 1))

    def forward(self, x):
        x = torch.tanh(self.first(x))
        for c in self.convs:
            x = torch.tanh(c(x)) + x
        return x.mean((2, 3))


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return capture(Stack().eval(), (torch.randn(2, 3, 9, 7),), method="fx")


def _plan(captured, bad_at: set[int], n_noop: int = 16) -> Plan:
    convs = [n.name for n in captured.gm.graph.nodes if op_kind(n) == "conv"]
    decisions = []
    for i in range(n_noop):
        rule = "test.scale" if i in bad_at else "test.noop"
        key = convs[i % len(convs)]
        decisions.append(Decision(rule, Site(rule, key, (key,), f"{rule} on {key}")))
    return Plan("stack", PlanSettings(), decisions)


def _fake_plan(n: int) -> Plan:
    return Plan(
        "fake", PlanSettings(), [Decision("r", Site("r", str(i), (str(i),), "")) for i in range(n)]
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.data())
def test_find_culprit_is_first_failure_in_log_calls(n, data):
    bad = data.draw(st.sets(st.integers(0, n - 1), max_size=3))
    plan = _fake_plan(n)
    calls = []

    def check(p):
        calls.append(len(p.decisions))
        return not any(int(d.site.key) in bad for d in p.decisions)

    got = find_culprit(plan, check)
    assert got == (min(bad) if bad else None)
    assert len(calls) <= 1 + math.ceil(math.log2(n)) if n > 1 else len(calls) == 1


def test_find_culprit_checks_bounds():
    with pytest.raises(ValueError):
        find_culprit(_fake_plan(4), lambda p: True, passing=3, failing=2)


def test_rollback_removes_exactly_the_culprits(fake_rules, captured, monkeypatch):
    applies = []
    real_apply = bisect_mod.apply_plan

    def counting(cap, plan, **kw):
        applies.append(len(plan.decisions))
        return real_apply(cap, plan, **kw)

    monkeypatch.setattr(bisect_mod, "apply_plan", counting)
    n, bad = 16, {5, 12}
    plan = _plan(captured, bad, n)
    kept, removed = rollback(captured, plan, captured.gm, "exact")

    assert [r.index for r in removed] == sorted(bad)
    assert all(r.decision.rule == "test.scale" for r in removed)
    assert all(d.rule == "test.noop" for d in kept.decisions) and len(kept.decisions) == n - 2
    for r in removed:
        assert r.metrics.rel_l2 > 1e-5 and "rel_l2" in r.reason
        assert r.to_json()["rule"] == "test.scale"
    k = len(bad)
    assert len(applies) <= (k + 1) * (1 + math.ceil(math.log2(n)))
    assert len(applies) < n  # fewer runs than trying every decision once
    # the plan that was kept passes
    final = bisect_mod.verify(captured.gm, real_apply(captured, kept).gm, captured.example_inputs)
    assert final.passed


def test_rollback_keeps_a_passing_plan(fake_rules, captured, monkeypatch):
    applies = []
    real_apply = bisect_mod.apply_plan
    monkeypatch.setattr(
        bisect_mod,
        "apply_plan",
        lambda cap, plan, **kw: applies.append(1) or real_apply(cap, plan, **kw),
    )
    plan = _plan(captured, set(), 8)
    kept, removed = rollback(captured, plan, captured.gm, "exact")
    assert removed == [] and kept.decisions == plan.decisions and len(applies) == 1


def test_rollback_under_looser_tolerance_keeps_scale(fake_rules, captured):
    plan = _plan(captured, {3}, 6)
    kept, removed = rollback(captured, plan, captured.gm, "lossy")
    assert removed == [] and len(kept.decisions) == 6


def test_rollback_refuses_a_reference_that_already_differs(fake_rules, captured):
    def other(x):
        return captured.gm(x) + 1.0

    with pytest.raises(VerificationError, match="before any replacement"):
        rollback(captured, _plan(captured, {1}, 4), other, "exact")
