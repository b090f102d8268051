import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes
from ._loops import CellLoop, inputs

RULE = "rnn.cell_loop"


def optimize(model: nn.Module, xs: tuple, method: str):
    model = model.eval()
    before = copy.deepcopy(model.state_dict())
    captured = capture(model, xs, method=method)
    plan = make_plan(captured, rules=[RULE])
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return captured, plan, applied


def fired(plan) -> int:
    return sum(d.rule == RULE for d in plan.decisions)


def reasons(plan) -> str:
    return " | ".join(m.reason for m in plan.misses if m.rule == RULE)


def assert_same(model: nn.Module, gm, xs: tuple, tol: float = 1e-5) -> None:
    for _ in range(2):
        fresh = tuple(torch.randn_like(t) for t in xs)
        with torch.no_grad():
            want, got = model(*fresh), gm(*fresh)
        assert want.shape == got.shape
        assert ((want - got).norm() / want.norm()).item() <= tol


@pytest.mark.parametrize(
    "kind,steps,batch,hidden,batch_first,initial,returns,method",
    [
        ("lstm", 5, 3, 7, True, True, "last", "fx"),
        ("lstm", 13, 1, 33, False, False, "all", "fx"),
        ("lstm", 5, 1, 33, True, False, "cat", "export"),
        ("gru", 13, 3, 7, True, True, "all", "fx"),
        ("gru", 5, 1, 33, False, True, "last", "export"),
        ("gru", 5, 3, 7, True, False, "last", "fx"),
        ("rnn", 5, 3, 7, False, True, "all", "fx"),
        ("lstm", 13, 3, 7, True, True, "all", "export"),
    ],
)
def test_cell_loop_becomes_one_sequence_module(
    kind, steps, batch, hidden, batch_first, initial, returns, method
):
    model = CellLoop(
        kind, 6, hidden, steps, batch_first=batch_first, initial=initial, returns=returns
    )
    xs = inputs(model, batch, 6)
    captured, plan, applied = optimize(model, xs, method)
    assert fired(plan) == 1, plan.misses
    cells = [n for n in applied.gm.graph.nodes if "cell" in str(n.target) and n.op != "call_module"]
    assert not [n for n in cells if "_cell" in str(n.target)], "a cell call was left behind"
    seq = [m for m in applied.gm.modules() if isinstance(m, nn.RNNBase)]
    assert len(seq) == 1 and seq[0].batch_first == batch_first
    assert not [m for m in applied.gm.modules() if isinstance(m, nn.RNNCellBase)]
    assert_same(model, applied.gm, xs)
    assert_same_at_other_shapes(model, captured, applied.gm, rel=1e-5)


def test_one_step_is_not_a_loop():
    model = CellLoop("lstm", 4, 7, 1)
    _, plan, _ = optimize(model, inputs(model, 3, 4), "fx")
    assert fired(plan) == 0 and not reasons(plan)


class Mixed(nn.Module):
    """In-place ops and a module that writes into its input around the loop; h is read
    at step 2 by a head as well as by the next step."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 6)
        self.act = nn.ReLU(inplace=True)
        self.cell = nn.LSTMCell(6, 9)
        self.head = nn.Linear(9, 4)
        self.norm = nn.BatchNorm1d(9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.proj(x))
        h = x.new_zeros(x.shape[0], 9)
        c = x.new_zeros(x.shape[0], 9)
        side = None
        for t in range(7):
            h, c = self.cell(x[:, t, :], (h, c))
            if t == 2:
                side = self.head(h)
        h = self.norm(h)
        h.mul_(2.0)
        return torch.cat([h, c, side], -1)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_in_place_and_stateful_modules_around_the_loop(method):
    model = Mixed().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
    xs = (torch.randn(3, 7, 5),)
    captured, plan, applied = optimize(model, xs, method)
    assert fired(plan) == 1, plan.misses
    assert_same(model, applied.gm, xs)
    assert_same_at_other_shapes(model, captured, applied.gm, rel=1e-5)


class Between(nn.Module):
    """Something sits between two steps: dropout, an in-place change, or a scale."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.cell = nn.GRUCell(4, 8)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        for t in range(5):
            h = self.cell(x[:, t], h)
            if self.what == "dropout":
                h = F.dropout(h, 0.2, self.training)
            elif self.what == "inplace":
                h.mul_(0.5)
            elif self.what == "scale":
                h = h * 0.5
        return h


@pytest.mark.parametrize(
    "what,reason",
    [
        ("dropout", "passes through dropout"),
        ("scale", "passes through mul"),
        ("inplace", "in place"),
    ],
)
def test_refuses_a_state_changed_between_steps(what, reason):
    model = Between(what)
    xs = (torch.randn(3, 5, 4), torch.randn(3, 8))
    _, plan, applied = optimize(model, xs, "fx")
    assert fired(plan) == 0
    assert reason in reasons(plan), reasons(plan)
    assert_same(model.eval(), applied.gm, xs, tol=1e-6)


class Steps(nn.Module):
    """Steps that do not walk one tensor forwards: backwards, from two tensors, or at an
    index computed from the input's length (a loop whose length follows the input)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.cell = nn.LSTMCell(4, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(x.shape[0], 6)
        for t in range(4):
            if self.how == "backwards":
                xt = x[:, 3 - t]
            elif self.how == "two":
                xt = (x if t % 2 else y)[:, t]
            else:
                xt = x[:, x.shape[1] - 4 + t]
            h, c = self.cell(xt, (h, c))
        return h


@pytest.mark.parametrize(
    "how,reason",
    [
        ("backwards", "backwards"),
        ("two", "not y along axis 1"),
        ("dynamic", "computed at run time"),
    ],
)
def test_refuses_steps_that_do_not_walk_one_tensor(how, reason):
    model = Steps(how)
    xs = (torch.randn(2, 6, 4), torch.randn(2, 6, 4))
    _, plan, applied = optimize(model, xs, "fx")
    assert fired(plan) == 0
    assert reason in reasons(plan), reasons(plan)


def test_two_cells_stacked_become_two_modules():
    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.GRUCell(3, 5), nn.GRUCell(5, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h1 = x.new_zeros(x.shape[0], 5)
            h2 = x.new_zeros(x.shape[0], 6)
            for t in range(6):
                h1 = self.a(x[:, t], h1)
                h2 = self.b(h1, h2)
            return h2

    model = Stacked()
    xs = (torch.randn(2, 6, 3),)
    _, plan, applied = optimize(model, xs, "fx")
    assert fired(plan) == 1
    assert "not a time step of one tensor" in reasons(plan) or "h1" in reasons(plan)
    assert_same(model.eval(), applied.gm, xs)
