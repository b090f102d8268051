"""The checks the base class makes for every rule: a rule that states only its pattern
(fusion.silu checks nothing else) is still refused where a rewrite would be wrong: a value
it consumes read elsewhere, an in-place write read afterwards or into an input, an in-place
write between the ops it merges. Judged against the user's module, at other sizes too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.graph import capture
from opswap.planner import apply_plan, make_plan
from opswap.rules import registry
from opswap.rules.base import Found, Rule


class Cases(nn.Module):
    def forward(self, x):
        h = x.exp()
        h.mul_(torch.sigmoid(h))  # in place into h, which the return reads
        s = torch.sigmoid(x)
        g = torch.relu(x)
        t = torch.sigmoid(g)
        g.add_(1.0)  # between sigmoid(g) and g * t
        u = g * t
        v = x * s  # s is also read below
        w = x.sin()
        return h, u, v + s, w * torch.sigmoid(w)  # the one that fuses


class IntoInput(nn.Module):
    def forward(self, x):
        x.mul_(torch.sigmoid(x))
        return x * 2


def _run(model, x):
    c = capture(model, (x,), method="fx")
    plan = make_plan(c, rules=["fusion.silu"])
    return plan, apply_plan(c, plan)


def test_the_base_refuses_what_a_pattern_alone_would_get_wrong():
    plan, applied = _run(Cases(), torch.randn(3, 5))
    reasons = " | ".join(m.reason for m in plan.misses)
    assert "writes into exp in place, and" in reasons
    assert "writes into relu in place between the ops" in reasons
    assert "also read by" in reasons
    assert len(plan.decisions) == 1
    for shape in ((3, 5), (1, 5), (6, 2)):
        x = torch.randn(*shape)
        for want, got in zip(Cases()(x.clone()), applied.gm(x.clone()), strict=True):
            torch.testing.assert_close(got, want)


def test_an_in_place_write_into_a_model_input_is_refused():
    plan, _ = _run(IntoInput(), torch.randn(4, 3))
    assert not plan.decisions
    assert any("writes into a model input in place" in m.reason for m in plan.misses)


class _Greedy(Rule):
    """Claims every relu together with the op before it, checking nothing."""

    name, family, chapter, exactness = "test.greedy", "test", 3, "exact"
    anchors = ("relu",)

    def check(self, gm, node):
        return Found((node.args[0], node), "merge")

    def rewrite(self, gm, found):
        raise AssertionError("never reached: the base refuses every site")


@pytest.fixture
def greedy():
    registry.register(_Greedy)
    yield
    registry._RULES.pop(_Greedy.name, None)


def test_a_consumed_value_read_elsewhere_refuses_any_rule(greedy):
    class Net(nn.Module):
        def forward(self, x):
            y = x.cos()
            return torch.relu(y) + y

    plan = make_plan(capture(Net(), (torch.randn(2, 3),), method="fx"), rules=["test.greedy"])
    assert not plan.decisions and not plan.failed
    assert "cos's output is also read by add" in plan.misses[0].reason
