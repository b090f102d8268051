"""norm.rms_norm: fires on every RMSNorm of a tiny Llama (HF's written-out form,
matched on what it computes), on Gemma's 1 + weight form with a weight buffer, and on
nn.RMSNorm; refused with the reason on a CPU target, over a non-last dim, with a run-time
eps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, llama, ops_in, plan, reasons

RULE = "norm.rms_norm"


def test_fires_on_every_norm_of_a_tiny_llama():
    lm, cap = llama()
    p, applied, _ = plan(lm.module, lm.example_inputs, [RULE], captured=cap)
    assert fired(p, RULE) == 5, (p.decisions, p.misses)  # 2 layers x 2 norms + the final one
    assert ops_in(applied.gm).count(torch.ops.opswap.rms_norm.default) == 5
    assert all(d.site.data["eps"] == 1e-6 for d in p.decisions)


def test_refused_on_a_cpu_target_with_the_reason():
    lm, cap = llama()
    p, _, _ = plan(lm.module, lm.example_inputs, [RULE], target="cpu", captured=cap)
    assert not p.decisions and len(p.skipped) == 5
    assert all(CPU_REASON in s.reason for s in p.skipped)


class Gemma(nn.Module):
    """Gemma's RMSNorm: fp32 math, (1 + weight) applied before the cast back; the weight
    a parameter or a buffer (the capture folds 1 + buffer into one constant); an in-place
    add after the norm."""

    def __init__(self, n=48, buffer=False):
        super().__init__()
        if buffer:
            self.register_buffer("weight", torch.randn(n) * 0.1)
        else:
            self.weight = nn.Parameter(torch.randn(n) * 0.1)
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        xf = x.float()
        h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        y = (h * (1.0 + self.weight.float())).type_as(x)
        y = self.lin(y)
        y.add_(1.0)
        return y


@pytest.mark.parametrize("buffer", [False, True])
def test_gemma_form_fires_with_its_offset(buffer):
    torch.manual_seed(0)
    m = Gemma(buffer=buffer).bfloat16().eval()
    p, applied, _ = plan(m, (torch.randn(2, 5, 48).bfloat16(),), [RULE])
    assert fired(p, RULE) == 1
    assert p.decisions[0].site.data["offset"] == (0.0 if buffer else 1.0)


class Misses(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(24)

    def forward(self, x, e):
        a = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-5)  # over dim 1, not last
        b = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e)  # eps from an input
        return a + b + self.norm(x)  # nn.RMSNorm: fires


def test_misses_say_why_and_nn_rms_norm_fires():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 24)
    p, _, _ = plan(Misses().eval(), (x, torch.tensor(1e-5)), [RULE])
    assert fired(p, RULE) == 1
    why = reasons(p, RULE)
    assert "not its last dim" in why and "eps is the model input e, not a constant" in why
