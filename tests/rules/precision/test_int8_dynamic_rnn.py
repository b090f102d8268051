"""precision.int8_dynamic_rnn: Int8DynamicRNN computes what nn.LSTM / nn.GRU compute
(within int8's error) for several layers, batch_first or not, unbatched inputs and given
initial states, at other batch sizes and lengths than the example's; the rule refuses
with reasons, and the plan's result matches the user's model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import opswap.rules.precision._timing as timing
from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan
from opswap.rules.precision._int8_rnn_module import Int8DynamicRNN
from opswap.targets.base import Target

RULE = "precision.int8_dynamic_rnn"
FIXED = Target(
    name="fixed-cpu",
    description="test profile",
    kind="cpu",
    peak_flops={"float32": 2.5e11, "int8": 1.0e12},
    mem_bandwidth=2.5e10,
    memory_bytes=2**34,
    dtypes=("float32", "int8"),
)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _outputs(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("layers,bias", [(1, True), (2, False)])
def test_module_matches_torch(kind, batch_first, layers, bias):
    torch.manual_seed(layers)
    rnn = kind(24, 80, num_layers=layers, bias=bias, batch_first=batch_first).eval()
    q = Int8DynamicRNN(rnn)
    for batch, steps in [(3, 7), (1, 1), (5, 12)]:
        shape = (batch, steps, 24) if batch_first else (steps, batch, 24)
        x = torch.randn(*shape)
        with torch.no_grad():
            want, got = _outputs(rnn(x)), _outputs(q(x))
        assert len(want) == len(got)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape
            assert _rel(g, w) < 0.03, (batch, steps, _rel(g, w))
    # given initial states, and an unbatched input
    h0 = torch.randn(layers, 2, 80) * 0.5
    hx = (h0, torch.randn(layers, 2, 80) * 0.5) if kind is nn.LSTM else h0
    x = torch.randn(2, 5, 24) if batch_first else torch.randn(5, 2, 24)
    with torch.no_grad():
        for w, g in zip(_outputs(rnn(x, hx)), _outputs(q(x, hx)), strict=True):
            assert _rel(g, w) < 0.03
        xu = torch.randn(6, 24)
        for w, g in zip(_outputs(rnn(xu)), _outputs(q(xu)), strict=True):
            assert g.shape == w.shape and _rel(g, w) < 0.03


class Seq(nn.Module):
    def __init__(self, hidden=96):
        super().__init__()
        self.lstm = nn.LSTM(32, hidden, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.small = nn.GRU(hidden, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.lstm(x)[0]
        h = self.gru(h)[0].relu_()
        return self.head(self.small(h)[0][:, -1])


def test_plan_takes_the_big_rnns_and_matches_the_users_model(monkeypatch):
    monkeypatch.setattr(timing, "timed_pair", lambda key, timer, make: (2e-3, 1e-3))
    torch.manual_seed(0)
    model = Seq().eval()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 10, 32)
    cap = capture(model, (x,), method="fx")
    plan = make_plan(cap, rules=[RULE], exactness="approx", target=FIXED)
    assert [d.site.key for d in plan.decisions] == ["lstm", "gru"], plan.decisions
    assert any("hidden size 16" in m.reason for m in plan.misses)
    applied = apply_plan(cap, plan)
    assert sum(isinstance(m, Int8DynamicRNN) for m in applied.gm.modules()) == 2
    for xs in (x, torch.randn(1, 3, 32), torch.randn(6, 15, 32)):
        with torch.no_grad():
            assert _rel(applied.gm(xs), model(xs)) < 0.03
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_refusals_say_why():
    model = nn.Sequential(nn.LSTM(8, 96, bidirectional=True)).eval()
    cap = capture(model, (torch.randn(5, 2, 8),), method="fx")
    plan = make_plan(cap, rules=[RULE], exactness="approx", target=FIXED)
    assert not plan.decisions and any("bidirectional" in m.reason for m in plan.misses)
    cap = capture(Seq().eval(), (torch.randn(2, 4, 32),), method="export")
    plan = make_plan(cap, rules=[RULE], exactness="approx", target=FIXED)
    assert not plan.decisions
