"""topk.topk: torch.topk over the last dim -> opswap::topk on a CUDA target where the
crossover table measured the kernel faster at the site's class, kept elsewhere (no
measurement, measured slower, a CPU target) with the reason; refuses another dim, an integer
tensor, a k computed at run time; `.values` / `.indices` of the named pair keep working;
a sort cut to its head becomes a topk first and then the kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.kernels import crossover
from opswap.kernels import topk as T
from opswap.planner import apply_plan, make_plan
from opswap.rules._triton import CPU_REASON

from .._shapes import assert_same_at_other_shapes

RULE = "topk.topk"


class Heads(nn.Module):
    def forward(self, x, n):
        a = torch.topk(x, 5)  # fires (when measured)
        b = x.topk(3, dim=-1, largest=False).indices  # fires, .indices
        c = torch.topk(x, 2, dim=1)  # another dim: refused
        d = torch.topk(n, 2)  # integers: refused
        e = torch.sort(x, -1, descending=True)[0][..., :4]  # sort_slice, then this rule
        return a.values, a[1], b, c[0], d[0], e


def _measured(monkeypatch, speedup: float) -> None:
    """A crossover table in which every top-k class of the test's shapes was measured."""
    real = crossover.lookup

    def lookup(kernel, device, dtype, hidden, rows, pass_="forward", entries=None, shape=None):
        if kernel != "topk":
            return real(kernel, device, dtype, hidden, rows, pass_, entries, shape)
        return crossover.Entry(
            "topk", device, str(dtype), shape or "", pass_, speedup > 1, None, speedup,
            source="measured test",
        )  # fmt: skip

    monkeypatch.setattr(crossover, "lookup", lookup)


def _plan(method, target, rules=(RULE,)):
    torch.manual_seed(0)
    m = Heads()
    x, n = torch.randn(3, 6, 40), torch.randint(0, 9, (3, 6, 40))
    cap = capture(m, (x, n), method=method)
    p = make_plan(cap, rules=list(rules), target=target)
    applied = apply_plan(cap, p)
    assert not p.failed and not applied.failed, (p.failed, applied.failed)
    for w, o in zip(m(x, n), applied.gm(x, n), strict=True):
        assert torch.equal(w, o)
    assert_same_at_other_shapes(m, cap, applied.gm, rel=0.0)
    return p, applied


def _reasons(p):
    return " | ".join(s.reason for s in [*p.misses, *p.skipped] if s.rule == RULE)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_where_measured_faster_and_says_why_elsewhere(method, monkeypatch):
    _measured(monkeypatch, 1.5)
    p, applied = _plan(method, "h200", (RULE, "topk.sort_slice"))
    assert sum(d.rule == RULE for d in p.decisions) == 3, (p.decisions, p.misses)
    assert sum(d.rule == "topk.sort_slice" for d in p.decisions) == 1
    ops = [n.target for n in applied.gm.graph.nodes]
    assert ops.count(torch.ops.opswap.topk.default) == 3
    why = _reasons(p)
    assert "the kernel takes the last dim" in why and "torch.int64" in why, why


def test_kept_where_unmeasured_slower_or_on_a_cpu():
    p, _ = _plan("fx", "h200")
    assert not p.decisions and "no measurement of the kernel at n<=64,k<=8" in _reasons(p)
    p, _ = _plan("fx", "cpu")
    assert not p.decisions and CPU_REASON in _reasons(p)


def test_measured_slower_keeps_torch_topk(monkeypatch):
    _measured(monkeypatch, 0.8)
    p, _ = _plan("export", "h200")
    assert not p.decisions and "measured at 0.8x torch.topk" in _reasons(p), _reasons(p)


def test_shape_classes_are_the_benchmark_grid():
    assert T.shape_class(1000, 3, 16) == "n<=1024,k<=4,rows<=16"
    assert T.shape_class(131072, 1024, 5000) == "n<=131072,k<=1024,rows>4096"
