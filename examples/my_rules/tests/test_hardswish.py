"""my_rules.hardswish fires on x * relu6(x + 3) / 6 in both capture flavours, says why it
does not fire, and the result computes what the user's module computes, at other sizes too.

    cd examples/my_rules && python -m pytest -q tests
"""

from __future__ import annotations

import my_rules.hardswish  # noqa: F401  (registers the rule, as the entry point does once installed)
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan

RULE = "my_rules.hardswish"


class HardSwishes(nn.Module):
    """Three spellings of hard-swish, one whose sum another op also reads, one off by 1."""

    def __init__(self):
        super().__init__()
        self.conv, self.relu6 = nn.Conv2d(3, 6, 3, padding=1), nn.ReLU6()

    def forward(self, x):
        y = self.conv(x)
        y = y * F.relu6(y + 3) / 6
        y = self.relu6(y + 3.0) * y / 6.0
        s = y + 3
        z = y * F.relu6(s) / 6 + s.mean()  # s is read by mean too
        return z * F.relu6(z + 2) / 6  # not hard-swish


class InPlace(nn.Module):
    def forward(self, x):
        y = x + 1
        y.div_(6)  # a hard-swish whose divide writes into a tensor read below
        z = y * F.relu6(y + 3)
        z.div_(6)
        return z + y


def _plan(model, x, method):
    captured = capture(model, (x,), method=method)
    return captured, make_plan(captured, rules=[RULE])


@pytest.mark.parametrize("method", ["fx", "export"])
def test_hardswish_fires_refuses_and_keeps_the_outputs(method):
    torch.manual_seed(0)
    model = HardSwishes().eval()
    x = torch.randn(2, 3, 11, 7)
    captured, plan = _plan(model, x, method)
    assert [d.rule for d in plan.decisions] == [RULE] * 2
    (miss,) = [m for m in plan.misses if m.rule == RULE]
    assert "also read by" in miss.reason
    applied = apply_plan(captured, plan)
    assert not applied.failed
    kinds = [str(n.target) for n in applied.gm.graph.nodes if n.op == "call_function"]
    assert sum("hardswish" in k for k in kinds) == 2
    # against the user's module itself, at the example's size and at others
    for xs in (x, torch.randn(1, 3, 11, 7), torch.randn(5, 3, 13, 9)):
        with torch.no_grad():
            torch.testing.assert_close(applied.gm(xs), model(xs), rtol=1e-5, atol=1e-6)


def test_an_in_place_divide_read_afterwards_is_a_near_miss():
    captured, plan = _plan(InPlace(), torch.randn(4, 9), "fx")
    assert not plan.decisions
    assert any("in place" in m.reason for m in plan.misses), plan.misses


def test_prediction_saves_traffic_and_dispatches():
    captured, plan = _plan(HardSwishes().eval(), torch.randn(2, 3, 11, 7), "fx")
    assert plan.decisions
    for d in plan.decisions:
        assert d.estimate.bytes_saved > 0 and d.estimate.time_saved_s > 0
