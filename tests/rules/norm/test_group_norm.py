"""norm.group_norm: takes nn.GroupNorm and nn.InstanceNorm2d(affine=True) in a small
conv model, in the fx capture (modules) and the torch.export one (aten.group_norm,
aten.instance_norm), where the crossover table says the kernel wins; refuses an
InstanceNorm with running stats; without a measurement a CUDA target keeps ATen's op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.kernels import crossover
from opswap.rules._triton import CPU_REASON

from .._triton_models import fired, ops_in, plan, reasons

RULE = "norm.group_norm"


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(4, 8)
        self.c2 = nn.Conv2d(8, 6, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(6, affine=True)
        self.stats = nn.InstanceNorm2d(6, track_running_stats=True)  # refused

    def forward(self, x):
        h = torch.relu(self.gn(self.c1(x)))
        h = self.inorm(self.c2(h))
        return h + self.stats(h)


def _model():
    torch.manual_seed(5)
    m = ConvNet().eval()
    with torch.no_grad():
        for norm in (m.gn, m.inorm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
        m.stats.running_mean.uniform_(-0.2, 0.2)
        m.stats.running_var.uniform_(0.5, 1.5)
    return m


@pytest.fixture
def measured_win(monkeypatch):
    """A crossover table in which group_norm beats eager at every shape (a test's
    stand-in for a measurement; the shipped table has none)."""
    real = crossover.lookup

    def lookup(kernel, device, dtype, hidden, rows, pass_="forward", entries=None, shape=None):
        if kernel == "group_norm":
            cls = crossover.shape_class(hidden, rows)
            return crossover.Entry(
                kernel, device, str(dtype).removeprefix("torch."), cls, pass_, True, None, 1.5
            )
        return real(kernel, device, dtype, hidden, rows, pass_, entries, shape)

    monkeypatch.setattr(crossover, "lookup", lookup)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_on_group_and_instance_norm_where_measured_faster(measured_win, method):
    m = _model()
    x = torch.randn(2, 3, 9, 11)
    p, applied, cap = plan(m, (x,), [RULE], method=method)
    # batch, height and width: the rewrite is checked at other sizes of each (plan())
    assert len(cap.dynamic.axes) == 3 and cap.dynamic.axis("batch"), cap.dynamic.describe()
    assert fired(p, RULE) == 2, (p.decisions, p.misses)
    assert ops_in(applied.gm).count(torch.ops.opswap.group_norm.default) == 2
    assert "running statistics" in reasons(p, RULE)
    groups = sorted(
        n.args[1]
        for n in applied.gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.opswap.group_norm.default
    )
    assert groups == [4, 6]  # the GroupNorm's 4, the InstanceNorm's one a channel


def test_without_a_measurement_cuda_keeps_aten_and_cpu_skips():
    m = _model()
    x = torch.randn(2, 3, 9, 11)
    p, applied, _ = plan(m, (x,), [RULE], method="export")
    assert not p.decisions
    assert ops_in(applied.gm).count(torch.ops.opswap.group_norm.default) == 0
    skipped = [s.reason for s in p.skipped if s.rule == RULE]
    assert len(skipped) == 2 and all("no measured crossover for group_norm" in r for r in skipped)
    p2, _, _ = plan(m, (x,), [RULE], method="export", target="cpu")
    assert not p2.decisions and all(CPU_REASON in s.reason for s in p2.skipped)
