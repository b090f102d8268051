"""activation.gelu_sigmoid: Linear -> GELU -> Linear becomes Linear -> SiLU -> Linear with
1.702 folded into the weights; the error against the user's module stays inside the
measured bound carried through the second Linear; refusals with reasons; exact and
approx plans do not apply it; hf:bert in both flavours."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation

from opswap.errors import RuleError
from opswap.graph.ops import op_kind
from opswap.rules.activation.gelu_sigmoid import ALPHA, MAX_ABS_ERROR

from ._act import bert, bert_mlp, fired, reasons, run

RULE = "activation.gelu_sigmoid"


def test_the_documented_bound_is_what_float64_measures():
    x = torch.linspace(-20, 20, 4_000_001, dtype=torch.float64)
    d = (F.gelu(x) - x * torch.sigmoid(ALPHA * x)).abs().max().item()
    assert d == pytest.approx(MAX_ABS_ERROR, rel=1e-3)


class MLPs(nn.Module):
    """Two MLPs (nn.GELU; GELUActivation between F.linear calls) after a BatchNorm in eval
    mode, a buffer and an in-place write; a third GELU read by an add (refused)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(12).eval()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
        self.register_buffer("shift", torch.randn(12))
        self.up, self.act, self.down = nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 12)
        self.w1, self.b1 = nn.Parameter(torch.randn(24, 12) * 0.3), nn.Parameter(torch.randn(24))
        self.w2 = nn.Parameter(torch.randn(12, 24) * 0.3)
        self.hf = GELUActivation()

    def forward(self, x):  # x: [B, S, 12]
        h = self.bn(x.reshape(-1, 12)).reshape(x.shape) + self.shift
        h.add_(0.25)  # in place, into a fresh tensor
        a = self.down(self.act(self.up(h)))
        b = F.linear(self.hf(F.linear(h, self.w1, self.b1)), self.w2)
        return a, b, F.gelu(h) + h


def bound(*weights) -> float:
    """What an error of MAX_ABS_ERROR per element becomes after x @ w.T: that times the
    largest absolute row sum of w."""
    return max(MAX_ABS_ERROR * w.detach().abs().sum(1).max().item() for w in weights)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_between_two_linears_inside_the_bound(method):
    torch.manual_seed(0)
    m = MLPs()
    plan, applied, err, _ = run(m, (torch.randn(3, 5, 12) * 2,), [RULE], method, "cpu", "lossy")
    assert fired(plan, RULE) == 2, (plan.decisions, plan.misses)
    assert "(add), not a Linear" in reasons(plan, RULE)
    kinds = [op_kind(n) for n in applied.gm.graph.nodes]
    assert kinds.count("silu") == 2 and kinds.count("gelu") == 1
    # the approximation's error carried through the second Linear, and not zero
    assert 1e-4 < err <= bound(m.down.weight, m.w2) * 1.01 + 1e-5


@pytest.mark.parametrize("exactness", ["exact", "approx"])
def test_exact_and_approx_plans_leave_it_out(exactness):
    plan, _, err, _ = run(
        MLPs(), (torch.randn(3, 5, 12),), ["activation.*"], "fx", "cpu", exactness
    )
    assert fired(plan, RULE) == 0 and err <= 1e-6
    assert any(RULE in n for n in plan.notes)  # "lossy rules not considered ..."
    with pytest.raises(RuleError, match="add --exactness lossy"):
        run(MLPs(), (torch.randn(3, 5, 12),), [RULE], "fx", "cpu", exactness)


class NotBetweenLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(12, 16), nn.Linear(16, 12)
        self.conv = nn.Conv1d(12, 16, 1)

    def forward(self, x):  # x: [B, S, 12]
        u = self.up(x)
        a = self.down(F.gelu(u)) + u.sum(-1, keepdim=True)  # up's output read twice
        c = F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)  # a conv before
        return a, self.down(c)


def test_refusals_say_why():
    torch.manual_seed(1)
    m = NotBetweenLinears()
    plan, _, err, _ = run(m, (torch.randn(3, 5, 12),), [RULE], "fx", "cpu", "lossy")
    assert fired(plan, RULE) == 0 and err <= 1e-6
    why = reasons(plan, RULE)
    assert "up's output is also read by sum" in why
    assert "reads conv (conv), not a Linear" in why


def test_cuda_targets_do_not_plan_it():
    plan, _, _, _ = run(MLPs(), (torch.randn(3, 5, 12),), [RULE], "fx", "h200", "lossy")
    assert fired(plan, RULE) == 0


def test_hf_bert_in_both_flavours():
    lm, cap = bert()
    plan, _, _, rel = run(lm.module, lm.example_inputs, [RULE], "export", "cpu", "lossy", cap)
    assert fired(plan, RULE) == 1, (plan.decisions, plan.misses)
    assert 1e-4 < rel <= 0.15  # the lossy tolerance's rel L2
    m, xs = bert_mlp()
    plan, _, _, rel = run(m, xs, [RULE], "fx", "cpu", "lossy")
    assert fired(plan, RULE) == 1 and 1e-4 < rel <= 0.15
