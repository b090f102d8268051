"""matmul.gemm: Linear / matmul / addmm (+ activation)(+ residual) -> opswap::gemm, on a
CUDA target profile, chosen by a timer injected into the target (ours or cuBLAS faster),
by the crossover table, or skipped as needing timing; the rewritten model computes the
user's at the example's batch and at others; near misses say why."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.kernels import crossover
from opswap.kernels import gemm as kg
from opswap.planner import apply_plan, make_plan
from opswap.targets import get_target

from .._shapes import assert_same_at_other_shapes

GEMM = torch.ops.opswap.gemm.default


class Block(nn.Module):
    """Linear + GELU, Linear + residual, a matmul by a parameter, addmm + SiLU."""

    def __init__(self, d: int = 12, h: int = 20):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.proj = nn.Parameter(torch.randn(d, 7) * 0.2)
        self.w2 = nn.Parameter(torch.randn(7, 9) * 0.3)
        self.b = nn.Parameter(torch.randn(9))

    def forward(self, x):
        y = self.down(torch.nn.functional.gelu(self.up(x))) + x
        z = y @ self.proj
        return torch.nn.functional.silu(torch.addmm(self.b, z.reshape(-1, 7), self.w2))


def _timer(cublas: float, ours: float):
    calls: list[str] = []

    def timer(fns):
        for name, fn in fns.items():  # the pair runs, as a real timer would run it
            assert fn().shape[-1] > 0
            calls.append(name)
        return {"cublas": cublas, "ours": ours}

    timer.calls = calls  # type: ignore[attr-defined]
    return timer


def _target(timer=None):
    return dataclasses.replace(get_target("h200"), timer=timer)


def _plan(model, x, timer, method="fx"):
    cap = capture(model, (x,), method=method)
    p = make_plan(cap, rules=["matmul.gemm"], target=_target(timer))
    return p, cap


@pytest.mark.parametrize("method", ["fx", "export"])
def test_ours_taken_where_timed_faster_and_verifies_at_other_batches(method):
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(3, 5, 12)
    timer = _timer(cublas=2e-5, ours=1e-5)
    p, cap = _plan(model, x, timer, method)
    applied = apply_plan(cap, p)
    assert not p.failed and not applied.failed
    acts = sorted(d.site.data["activation"] for d in p.decisions if d.rule == "matmul.gemm")
    assert acts == ["gelu", "none", "none", "silu"], p.decisions
    assert [d.site.data["residual"] for d in p.decisions].count(True) == 1
    assert sum(n.target is GEMM for n in applied.gm.graph.nodes) == 4
    assert {"cublas", "ours"} <= set(timer.calls)
    with torch.no_grad():
        torch.testing.assert_close(applied.gm(x), model(x), rtol=1e-5, atol=1e-5)
    assert_same_at_other_shapes(model, cap, applied.gm, rel=1e-5)


def test_cublas_kept_where_timed_faster_with_both_times():
    torch.manual_seed(0)
    p, _ = _plan(Block().eval(), torch.randn(4, 12), _timer(cublas=1e-5, ours=3e-5))
    assert not [d for d in p.decisions if d.rule == "matmul.gemm"]
    reasons = [s.reason for s in p.skipped if s.rule == "matmul.gemm"]
    assert len(reasons) == 4
    assert all("cuBLAS and the separate ops 10.0 us, opswap::gemm 30.0 us" in r for r in reasons)


def test_without_a_timer_it_needs_timing_or_a_measured_entry(monkeypatch):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 24), nn.ReLU()).eval(), torch.randn(8, 16)
    p, _ = _plan(model, x, None)
    assert not p.decisions
    assert "needs timing on the target" in p.skipped[0].reason
    shape = kg.shape_class(8, 24, 16)
    measured = crossover.Entry(
        "gemm", "sm90", "float32", shape, "forward", True, None, 1.3, None, "measured test"
    )
    monkeypatch.setattr(crossover, "load", lambda path=None: [measured])
    p, cap = _plan(model, x, None)
    assert [d.site.data["activation"] for d in p.decisions] == ["relu"]
    assert "1.3x cuBLAS" in p.decisions[0].estimate.note


def test_cpu_target_does_not_take_the_rule():
    cap = capture(nn.Linear(4, 4), (torch.randn(2, 4),))
    p = make_plan(cap, rules=["matmul.gemm"], target="cpu")
    assert not p.decisions


def test_near_misses_say_why():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6).double()
            self.w3 = nn.Parameter(torch.randn(2, 6, 5))

        def forward(self, x):
            y = self.lin(x.double()).float()
            return y @ self.w3, torch.addmm(y[0, :5], y, self.w3[0], beta=0.5)

    p, _ = _plan(Odd(), torch.randn(2, 6), _timer(1e-5, 1e-6))
    why = " | ".join(m.reason for m in p.misses if m.rule == "matmul.gemm")
    assert "computes in torch.float64" in why
    assert "not a 2-D matrix (a batched product)" in why
    assert "scales its terms" in why
    assert not p.decisions


def test_a_shared_intermediate_stops_the_epilogue():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return torch.relu(h) + h  # h is read twice: the ReLU cannot fold

    torch.manual_seed(1)
    model, x = Shared().eval(), torch.randn(3, 8)
    p, cap = _plan(model, x, _timer(2e-5, 1e-5))
    assert [d.site.data["activation"] for d in p.decisions] == ["none"]
    applied = apply_plan(cap, p)
    with torch.no_grad():
        torch.testing.assert_close(applied.gm(x), model(x))
