"""Chapter 9: activations. A block holding the activations models write out by hand
(GPT-2's gelu_new formula, CLIP's QuickGELU, MobileNetV3's hard-swish) and a BERT-style
Linear + GELU, planned for the H200 and for this CPU at each exactness, then the H200
plan applied here and checked against the block at another batch size.

    python examples/ch09_activations.py
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import opswap
from opswap.graph.capture import capture
from opswap.planner import make_plan


class Block(nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.gate = nn.Linear(width, width)
        self.mobile = nn.Linear(width, width)

    def forward(self, x):
        h = self.up(x)
        # GPT-2's NewGELUActivation, as transformers writes it: eight kernels in eager
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3)))
        y = self.down(h)
        q = self.gate(y)
        y = y + q * torch.sigmoid(1.702 * q)  # QuickGELU
        m = self.mobile(y)
        y = y + m * F.relu6(m + 3.0) / 6.0  # hard-swish written out
        return F.gelu(self.down(F.gelu(self.up(y))))  # BERT's erf GELU after a Linear


def show(title: str, plan) -> None:
    print(f"{title}: {len(plan.decisions)} sites")
    for d in plan.decisions:
        print(f"  {d.rule:30s} {d.site.description}")
    for s in plan.skipped[:4]:
        print(f"  skipped {s.rule}: {s.reason[:110]}")


def main() -> None:
    torch.manual_seed(0)
    block = Block().eval().to(torch.bfloat16)
    x = torch.randn(16, 64, 256, dtype=torch.bfloat16)  # 1024 rows
    cap, rules = capture(block, (x,)), "activation.*"  # one capture, three plans
    show("h200, exact", make_plan(cap, target="h200", rules=rules))
    approx = make_plan(cap, target="h200", rules=rules, exactness="approx")
    show("h200, approx (erf GELU -> tanh, then the Linear's epilogue)", approx)
    show("cpu, lossy", make_plan(cap, target="cpu", rules=rules, exactness="lossy"))

    # the H200 plan's rewrites run on this CPU too (each op falls back to its reference
    # here, and _addmm_activation computes the erf GELU on a CPU): same function
    fast = opswap.apply(block.float(), (x.float(),), approx, allow_looser=True)
    other = torch.randn(3, 64, 256)
    with torch.no_grad():
        want, got = block(other), fast(other)
    rel = float((got - want).norm() / want.norm())
    print(f"the approx plan's module at batch 3 against the block: rel. L2 {rel:.2e}")
    assert rel < 1e-3, rel


if __name__ == "__main__":
    main()
