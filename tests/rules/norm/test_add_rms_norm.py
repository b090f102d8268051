"""norm.add_rms_norm: folds each residual add of a tiny Llama into the RMSNorm it
feeds (the sum still reaches its later readers), planned before norm.rms_norm,
which takes the one norm without an add; refuses an add that broadcasts."""

from __future__ import annotations

import torch
from torch import nn

from .._triton_models import fired, llama, ops_in, plan, reasons

RULE = "norm.add_rms_norm"


def test_folds_the_residual_adds_of_a_tiny_llama():
    lm, cap = llama()
    p, applied, _ = plan(lm.module, lm.example_inputs, ["norm.*"], captured=cap)
    assert fired(p, RULE) == 4 and fired(p, "norm.rms_norm") == 1, p.decisions
    assert [d.rule for d in p.decisions][:4] == [RULE] * 4  # it runs first
    ops = ops_in(applied.gm)
    assert ops.count(torch.ops.opswap.add_rms_norm.default) == 4


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.RMSNorm(32), nn.RMSNorm(32)
        self.bias = nn.Parameter(torch.randn(32))

    def forward(self, x, r):
        s = x + r
        t = x + self.bias  # broadcasts a [32] parameter: refused
        return self.a(s) + s * 2, self.b(t)


def test_the_sum_reaches_its_readers_and_a_broadcast_is_refused():
    torch.manual_seed(2)
    x, r = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    p, applied, _ = plan(Residual().eval(), (x, r), [RULE])
    assert fired(p, RULE) == 1
    assert "broadcasts or promotes" in reasons(p, RULE)
