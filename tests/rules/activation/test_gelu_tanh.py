"""activation.gelu_tanh: erf-GELU in its spellings becomes the tanh form where a Linear
epilogue then takes it (CUDA), and is skipped with the reason where nothing does and on a
CPU; the error against the user's module stays inside the measured bound; an exact plan
does not apply it; on hf:bert it makes the MLP's GELU foldable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation

from opswap.rules.activation.gelu_tanh import CPU_NOTE, MAX_ABS_ERROR

from ._act import BertMLP, bert, bert_mlp, calls, fired, run, skipped

RULE, EPILOGUE = "activation.gelu_tanh", "activation.linear_epilogue"
ADDMM_ACT = torch.ops.aten._addmm_activation.default


def test_the_documented_bound_is_what_float64_measures():
    x = torch.linspace(-20, 20, 4_000_001, dtype=torch.float64)
    d = (F.gelu(x) - F.gelu(x, approximate="tanh")).abs().max().item()
    assert d == pytest.approx(MAX_ABS_ERROR, rel=1e-3)


class Gelus(nn.Module):
    """Three erf GELUs after Linears (nn.GELU, F.gelu, transformers' GELUActivation), one
    after a BatchNorm in eval mode; a buffer and an in-place write before them."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(12).eval()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
        self.register_buffer("shift", torch.randn(12))
        self.a, self.b, self.c = nn.Linear(12, 20), nn.Linear(12, 18), nn.Linear(12, 14)
        self.act, self.hf = nn.GELU(), GELUActivation()

    def forward(self, x):  # x: [B, S, 12]
        h = self.bn(x.reshape(-1, 12)).reshape(x.shape) + self.shift
        h.mul_(1.5)  # in place, into a fresh tensor
        return self.act(self.a(h)), F.gelu(self.b(h)), self.hf(self.c(h)), F.gelu(h)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_where_an_epilogue_takes_it_and_stays_inside_the_bound(method):
    torch.manual_seed(0)
    m = Gelus()
    plan, applied, err, _ = run(m, (torch.randn(3, 5, 12) * 3,), [RULE], method, "h200", "approx")
    assert fired(plan, RULE) == 3, (plan.decisions, plan.skipped)
    assert "no Linear epilogue takes the tanh form here" in skipped(plan, RULE)
    assert all("linear_epilogue fold" in d.estimate.note for d in plan.decisions)
    tanh = [n for n in applied.gm.graph.nodes if n.kwargs.get("approximate") == "tanh"]
    assert len(tanh) == 3
    assert 1e-6 < err <= MAX_ABS_ERROR * 1.001 + 1e-6  # each output is a GELU's, so the bound holds


@pytest.mark.parametrize("method", ["fx", "export"])
def test_an_exact_plan_leaves_it_out_and_a_cpu_target_skips_it(method):
    torch.manual_seed(1)
    plan, applied, err, _ = run(Gelus(), (torch.randn(3, 5, 12),), ["activation.*"], method)
    assert fired(plan, RULE) == 0 and err <= 1e-6
    assert any(RULE in n for n in plan.notes)  # "approx rules not considered ..."
    plan, _, _, _ = run(Gelus(), (torch.randn(3, 5, 12),), [RULE], method, "cpu", "approx")
    assert fired(plan, RULE) == 0 and CPU_NOTE in skipped(plan, RULE)


def test_hf_bert_erf_gelu_becomes_tanh_and_folds_into_the_epilogue():
    lm, cap = bert()
    rules = [RULE, EPILOGUE]
    plan, applied, _, rel = run(
        lm.module, lm.example_inputs, rules, "export", "h200", "approx", cap
    )
    assert fired(plan, RULE) == 1 and fired(plan, EPILOGUE) == 1, (plan.decisions, plan.misses)
    assert [d.rule for d in plan.decisions] == rules  # tanh first, then the fold
    assert calls(applied.gm, ADDMM_ACT) == 1
    # on this CPU the folded op computes erf-GELU (see linear_epilogue): BERT's own function
    assert rel <= 1e-5
    # tanh alone moves BERT's output by the approximation only
    plan, applied, _, rel = run(
        lm.module, lm.example_inputs, [RULE], "export", "h200", "approx", cap
    )
    assert fired(plan, RULE) == 1 and 1e-7 < rel <= 1e-3


def test_hf_bert_mlp_in_the_fx_flavour():
    m, xs = bert_mlp()
    assert isinstance(m, BertMLP)
    plan, applied, _, rel = run(m, xs, [RULE, EPILOGUE], "fx", "h200", "approx")
    assert fired(plan, RULE) == 1 and fired(plan, EPILOGUE) == 1, (plan.decisions, plan.misses)
    assert calls(applied.gm, ADDMM_ACT) == 1 and rel <= 1e-5
