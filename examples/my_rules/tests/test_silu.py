"""my_rules.silu fires on x * sigmoid(x) in both capture flavours, says why it does not
fire, and the result computes what the user's module computes, at other sizes too.

    cd examples/my_rules && python -m pytest -q tests
"""

from __future__ import annotations

import my_rules.silu  # noqa: F401  (registers the rule, as the entry point does once installed)
import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan


class Swish(nn.Module):
    """Three spellings of x * sigmoid(x), and a sigmoid that another op also reads."""

    def __init__(self):
        super().__init__()
        self.conv, self.sig = nn.Conv2d(3, 6, 3, padding=1), nn.Sigmoid()

    def forward(self, x):
        y = self.conv(x)
        y = y * torch.sigmoid(y)
        y = self.sig(y) * y
        z = y * y.sigmoid()
        s = torch.sigmoid(z)
        return z * s + s.mean()


class InPlace(nn.Module):
    def forward(self, x):
        y = x + 1
        y.mul_(torch.sigmoid(y))  # writes into y, which silu(y) would not
        return y


def _plan(model, x, method):
    captured = capture(model, (x,), method=method)
    return captured, make_plan(captured, rules=["my_rules.silu"])


@pytest.mark.parametrize("method", ["fx", "export"])
def test_silu_fires_refuses_and_keeps_the_outputs(method):
    torch.manual_seed(0)
    model = Swish().eval()
    x = torch.randn(2, 3, 11, 7)
    captured, plan = _plan(model, x, method)
    assert [d.rule for d in plan.decisions] == ["my_rules.silu"] * 3
    (miss,) = [m for m in plan.misses if m.rule == "my_rules.silu"]
    assert "also read by" in miss.reason
    applied = apply_plan(captured, plan)
    assert not applied.failed
    kinds = [str(n.target) for n in applied.gm.graph.nodes if n.op == "call_function"]
    assert sum("silu" in k for k in kinds) == 3
    # against the user's module itself, at the example's size and at others
    for xs in (x, torch.randn(1, 3, 11, 7), torch.randn(5, 3, 13, 9)):
        with torch.no_grad():
            torch.testing.assert_close(applied.gm(xs), model(xs), rtol=1e-5, atol=1e-6)


def test_an_in_place_mul_is_a_near_miss():
    _, plan = _plan(InPlace(), torch.randn(4, 9), "export")
    assert not plan.decisions
    assert any("in place" in m.reason for m in plan.misses), plan.misses


def test_prediction_saves_traffic_and_a_dispatch():
    captured, plan = _plan(Swish().eval(), torch.randn(2, 3, 11, 7), "fx")
    for d in plan.decisions:
        assert d.estimate.bytes_saved > 0 and d.estimate.time_saved_s > 0
