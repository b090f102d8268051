import copy

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.kernels import crossover
from opswap.models.zoo_misc import seq_model
from opswap.planner import apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes

RULE = "rnn.fused_seq"


class Stack(nn.Module):
    """A two-layer time-major LSTM with a given state, then a batch-first GRU without
    bias or state; every output read."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 9, num_layers=2)
        self.gru = nn.GRU(9, 7, batch_first=True, bias=False)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        o, (hn, cn) = self.lstm(x, (h, c))
        o2, hg = self.gru(o.transpose(0, 1))
        return o2.sum(1) + hn[1][:, :7] + cn[0][:, :7] + hg[0]


@pytest.fixture
def measured(monkeypatch):
    """A crossover table in which both kernels beat cuDNN at every shape."""
    real = crossover.lookup

    def lookup(kernel, device, dtype, hidden, rows, *a, **k):
        if kernel in ("lstm_seq", "gru_seq"):
            return crossover.Entry(
                kernel, device, "float32", "any", "forward", True, None, 1.5, None, "measured test"
            )
        return real(kernel, device, dtype, hidden, rows, *a, **k)

    monkeypatch.setattr(crossover, "lookup", lookup)


def _plan(model, xs, method, target):
    model = model.eval()
    before = copy.deepcopy(model.state_dict())
    captured = capture(model, xs, method=method)
    plan = make_plan(captured, rules=[RULE], target=target)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return captured, plan, applied


@pytest.mark.parametrize("method", ["fx", "export"])
def test_measured_faster_lstm_and_gru_become_the_kernel_ops(measured, method):
    model = Stack()
    xs = (torch.randn(6, 3, 5), torch.randn(2, 3, 9), torch.randn(2, 3, 9))
    captured, plan, applied = _plan(model, xs, method, "h100")
    assert sum(d.rule == RULE for d in plan.decisions) == 2, (plan.misses, plan.skipped)
    ops = {n.target for n in applied.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.opswap.lstm_seq.default in ops and torch.ops.opswap.gru_seq.default in ops
    assert not [n for n in applied.gm.graph.nodes if n.op == "call_module"]
    with torch.no_grad():
        for _ in range(2):
            fresh = tuple(torch.randn_like(t) for t in xs)
            torch.testing.assert_close(applied.gm(*fresh), model(*fresh), atol=1e-5, rtol=1e-5)
    assert_same_at_other_shapes(model, captured, applied.gm, rel=1e-5)


def test_zoo_seq_becomes_the_kernel_ops(measured):
    model, xs = seq_model(batch=3, seq=7, features=5, hidden=11)
    captured, plan, applied = _plan(model, xs, "fx", "h100")
    assert sum(d.rule == RULE for d in plan.decisions) == 2
    assert_same_at_other_shapes(model, captured, applied.gm, rel=1e-5)


def test_not_measured_or_cpu_is_skipped_with_the_reason():
    model, xs = seq_model(batch=2, seq=5, features=4, hidden=6)
    captured = capture(model, xs, method="fx")
    on_gpu = make_plan(captured, rules=[RULE], target="h100")
    assert not on_gpu.decisions
    assert "not measured against cuDNN" in " ".join(s.reason for s in on_gpu.skipped)
    on_cpu = make_plan(captured, rules=[RULE], target="cpu")
    assert not on_cpu.decisions


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bi = nn.LSTM(4, 5, bidirectional=True, batch_first=True)
        self.flat = nn.GRU(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bi(x)[0].sum() + self.flat(x[0])[0].sum()  # x[0]: an unbatched [T, F]


def test_refuses_bidirectional_and_unbatched_with_reasons(measured):
    _, plan, _ = _plan(Odd(), (torch.randn(2, 3, 4),), "fx", "h100")
    reasons = " | ".join(m.reason for m in plan.misses if m.rule == RULE)
    assert not plan.decisions
    assert "bidirectional" in reasons and "not a batched" in reasons, reasons


def test_a_cell_loop_becomes_one_module_then_the_kernel(measured):
    """On CUDA both rules run in one plan: the loop -> nn.LSTM -> opswap::lstm_seq."""
    from ._loops import CellLoop, inputs

    model = CellLoop("lstm", 6, 10, 5, returns="all")
    xs = inputs(model, 3, 6)
    captured = capture(model.eval(), xs, method="fx")
    plan = make_plan(captured, rules=["rnn.*"], target="h100")
    assert [d.rule for d in plan.decisions] == ["rnn.cell_loop", RULE], plan.skipped
    gm = apply_plan(captured, plan).gm
    assert any(n.target is torch.ops.opswap.lstm_seq.default for n in gm.graph.nodes)
    assert_same_at_other_shapes(model, captured, gm, rel=1e-5)


class Handoff(nn.Module):
    """One LSTM's (h, c) handed whole to the next as its initial state."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.LSTM(4, 6, batch_first=True), nn.LSTM(6, 6, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o, state = self.a(x)
        return self.b(o, state)[0]


def test_refuses_a_state_tuple_handed_on_whole(measured):
    _, plan, _ = _plan(Handoff(), (torch.randn(2, 5, 4),), "fx", "h100")
    reasons = " | ".join(m.reason for m in plan.misses if m.rule == RULE)
    assert not plan.decisions
    assert "reads getitem_1's outputs as a whole" in reasons and "one value" in reasons, reasons
