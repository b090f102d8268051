"""reduce.sum_of_squares: fires on every RMSNorm's mean of squares of a tiny Llama
(when the norm rule is not in the plan), on x.pow(2).sum(-1), (x * x).sum(-1) and
x.square().mean(-1, keepdim=True); refuses another dim, an accumulation dtype, and on a CPU
target."""

from __future__ import annotations

import torch
from torch import nn

from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, llama, ops_in, plan, reasons

RULE = "reduce.sum_of_squares"


def test_fires_on_the_norms_of_a_tiny_llama():
    lm, cap = llama()
    p, applied, _ = plan(lm.module, lm.example_inputs, [RULE], captured=cap)
    assert fired(p, RULE) == 5, (p.decisions, p.misses)
    assert ops_in(applied.gm).count(torch.ops.opswap.row_reduce.default) == 5
    both = plan(lm.module, lm.example_inputs, [RULE, "norm.rms_norm"], captured=cap)[0]
    assert fired(both, RULE) == 0 and fired(both, "norm.rms_norm") == 5  # the norm first
    p2, _, _ = plan(lm.module, lm.example_inputs, [RULE], target="cpu", captured=cap)
    assert not p2.decisions and all(CPU_REASON in s.reason for s in p2.skipped)


class Energies(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(30, 30)

    def forward(self, x):
        h = self.lin(x)
        a = h.pow(2).sum(-1)  # fires
        b = (h * h).sum(dim=-1)  # fires
        c = h.square().mean(-1, keepdim=True)  # fires, keepdim
        d = h.pow(2).sum(1)  # another dim: refused
        e = (h * h).sum(-1, dtype=torch.float64)  # refused
        return a + b + c.squeeze(-1) + e.float(), d


def test_forms_fire_and_misses_say_why():
    torch.manual_seed(2)
    for method in ("fx", "export"):
        p, applied, _ = plan(Energies().eval(), (torch.randn(4, 9, 30),), [RULE], method=method)
        assert fired(p, RULE) == 3, (method, p.decisions, p.misses)
        why = reasons(p, RULE)
        assert "not the last one" in why and "another dtype" in why, why
