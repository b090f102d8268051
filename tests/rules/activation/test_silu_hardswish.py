"""activation.silu_hardswish: SiLU in its spellings becomes Hardswish; the error against the
user's module stays inside the measured bound; exact and approx plans do not apply it; it
runs before gelu_sigmoid, whose SiLU stands for a GELU; hf:bert with SiLU in both flavours."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.rules.activation.silu_hardswish import MAX_ABS_ERROR

from ._act import bert, bert_mlp, fired, run

RULE = "activation.silu_hardswish"


def test_the_documented_bound_is_what_float64_measures():
    x = torch.linspace(-20, 20, 4_000_001, dtype=torch.float64)
    d = (F.silu(x) - F.hardswish(x)).abs().max().item()
    assert d == pytest.approx(MAX_ABS_ERROR, rel=1e-3)


class Silus(nn.Module):
    """nn.SiLU, F.silu and F.silu in place on a fresh tensor, after a BatchNorm in eval
    mode and a buffer; a Linear -> GELU -> Linear for gelu_sigmoid."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(12).eval()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
        self.register_buffer("shift", torch.randn(12))
        self.act = nn.SiLU()
        self.up, self.down = nn.Linear(12, 16), nn.Linear(16, 12)

    def forward(self, x):  # x: [B, S, 12]
        h = self.bn(x.reshape(-1, 12)).reshape(x.shape) + self.shift
        g = h * 2
        return self.act(h), F.silu(h - 1), F.silu(g, inplace=True), self.down(F.gelu(self.up(h)))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_on_every_spelling_inside_the_bound(method):
    torch.manual_seed(0)
    m = Silus()
    plan, applied, err, _ = run(m, (torch.randn(3, 5, 12) * 3,), [RULE], method, "cpu", "lossy")
    assert fired(plan, RULE) == 3, (plan.decisions, plan.misses)
    kinds = [str(n.target) for n in applied.gm.graph.nodes]
    assert sum("hardswish" in k for k in kinds) == 3 and not any("silu" in k for k in kinds)
    assert 1e-2 < err <= MAX_ABS_ERROR * 1.001 + 1e-6  # outputs 0-2 are the activations


def test_runs_before_gelu_sigmoid_so_its_silu_is_kept():
    torch.manual_seed(1)
    rules = [RULE, "activation.gelu_sigmoid"]
    plan, applied, _, _ = run(Silus(), (torch.randn(3, 5, 12),), rules, "fx", "cpu", "lossy")
    assert [d.rule for d in plan.decisions] == [RULE] * 3 + ["activation.gelu_sigmoid"]
    kinds = [str(n.target) for n in applied.gm.graph.nodes]
    assert sum("silu" in k for k in kinds) == 1  # the quick GELU's


@pytest.mark.parametrize("exactness", ["exact", "approx"])
def test_exact_and_approx_plans_leave_it_out(exactness):
    plan, _, err, _ = run(
        Silus(), (torch.randn(3, 5, 12),), ["activation.*"], "export", "cpu", exactness
    )
    assert fired(plan, RULE) == 0 and err <= 1e-6
    assert any(RULE in n for n in plan.notes)  # "lossy rules not considered ..."
    with pytest.raises(RuleError, match="add --exactness lossy"):
        run(Silus(), (torch.randn(3, 5, 12),), [RULE], "export", "cpu", exactness)


def test_hf_bert_with_silu_in_both_flavours():
    lm, cap = bert(hidden_act="silu")
    plan, _, _, rel = run(lm.module, lm.example_inputs, [RULE], "export", "cpu", "lossy", cap)
    assert fired(plan, RULE) == 1, (plan.decisions, plan.misses)
    assert 1e-4 < rel <= 0.15
    m, xs = bert_mlp(hidden_act="silu")
    plan, _, _, rel = run(m, xs, [RULE], "fx", "cpu", "lossy")
    assert fired(plan, RULE) == 1 and 1e-4 < rel <= 0.15
