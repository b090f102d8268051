"""What the tests of the GPU low-bit rules share: a small bfloat16 decoder-like block, a
plan on the h200 target, and a switch that lets the rules take CPU weights (so that the
rewrite and the installed module's CPU path are tested here; the GPU suite runs them on
the GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan
from opswap.rules.precision import _lowbit
from opswap.targets import get_target

from .._shapes import other_shapes


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(256, 256, bias=False)
        self.up = nn.Linear(256, 704)
        self.down = nn.Linear(704, 256, bias=False)
        self.tiny = nn.Linear(256, 24)  # 24 outputs: not a multiple of 16 (FP8 refuses)
        self.w = nn.Parameter(torch.randn(128, 256) * 0.05)  # functional F.linear

    def forward(self, x):
        h = self.q(x)
        y = self.down(torch.relu(self.up(h))) + x
        return nn.functional.linear(y, self.w), self.tiny(y)


def block():
    torch.manual_seed(0)
    return Block().bfloat16().eval()


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """The rules take CPU weights as if they were on a capable GPU."""
    monkeypatch.setattr(_lowbit, "gpu_reason", lambda device, scheme: None)


#: the H200 with no launch cost and 100x the bandwidth, on which every GEMM is
#: compute-bound: the test model's GEMMs are far too small for FP8 to pay on the real
#: profile (a test of its own)
COMPUTE_BOUND = dataclasses.replace(
    get_target("h200"), name="h200-compute-bound", dispatch_s=0.0, mem_bandwidth=4.8e14
)


def plan(model, x, rule, method="fx", exactness="lossy", target="h200"):
    cap = capture(model, (x,), method=method)
    p = make_plan(cap, rules=[rule], exactness=exactness, target=target)
    return cap, p, apply_plan(cap, p)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def worst_error(model, cap, applied, x) -> float:
    """The largest relative error of the rewritten model against the user's, at the
    example and at other batch and sequence sizes."""
    worst, seen = 0.0, 0
    for _, xs in [("example", (x,)), *other_shapes(cap)]:
        with torch.inference_mode():
            for w, g in zip(model(*xs), applied.gm(*xs), strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype
                worst = max(worst, rel(g, w))
        seen += 1
    assert seen >= 3
    return worst
