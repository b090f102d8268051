"""activation.swiglu: fires on the MLPs of a tiny Llama (two tensors), on the two
halves of one Linear's output (the packed op), refuses a broadcasting product."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, llama, ops_in, plan, reasons

RULE = "activation.swiglu"


def test_fires_on_the_mlps_of_a_tiny_llama():
    lm, cap = llama()
    p, applied, _ = plan(lm.module, lm.example_inputs, [RULE], captured=cap)
    assert fired(p, RULE) == 2
    assert ops_in(applied.gm).count(torch.ops.opswap.glu.default) == 2
    p2, _, _ = plan(lm.module, lm.example_inputs, [RULE], target="cpu", captured=cap)
    assert not p2.decisions and all(CPU_REASON in s.reason for s in p2.skipped)


class Merged(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(32, 2 * 48)
        self.down = nn.Linear(48, 32)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        y = self.down(F.silu(g) * u)
        return y + F.silu(x) * x[..., :1]  # broadcasts: refused


def test_halves_of_one_linear_take_the_packed_op_and_a_broadcast_is_refused():
    torch.manual_seed(4)
    for method in ("fx", "export"):
        p, applied, _ = plan(Merged().eval(), (torch.randn(2, 5, 32),), [RULE], method=method)
        assert fired(p, RULE) == 1, (method, p.decisions, p.misses)
        assert torch.ops.opswap.glu_packed.default in ops_in(applied.gm)
        assert "broadcasts or promotes" in reasons(p, RULE)
