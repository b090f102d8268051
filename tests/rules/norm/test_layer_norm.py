"""norm.layer_norm: takes nn.LayerNorm and the written-out LayerNorm that
fusion.layer_norm leaves as one; refuses a LayerNorm over two dims."""

from __future__ import annotations

import torch
from torch import nn

from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, ops_in, plan, reasons

RULE = "norm.layer_norm"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(40)
        self.ln2 = nn.LayerNorm((5, 40))  # two dims: refused
        self.lin = nn.Linear(40, 40)

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        h = (x - m) / torch.sqrt(v + 1e-5)  # written out: fusion.layer_norm makes it one op
        return self.ln(self.lin(h)) + self.ln2(x)


def test_fires_on_modules_and_after_fusion_and_refuses_two_dims():
    torch.manual_seed(3)
    m = Block().eval()
    with torch.no_grad():
        m.ln.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 40)
    p, applied, _ = plan(m, (x,), ["fusion.layer_norm", RULE])
    assert fired(p, RULE) == 2 and fired(p, "fusion.layer_norm") == 1, p.decisions
    assert ops_in(applied.gm).count(torch.ops.opswap.layer_norm.default) == 2
    assert "the kernel normalises the last one" in reasons(p, RULE)
    p2, _, _ = plan(m, (x,), [RULE], method="export", target="cpu")
    assert not p2.decisions and all(CPU_REASON in s.reason for s in p2.skipped)
