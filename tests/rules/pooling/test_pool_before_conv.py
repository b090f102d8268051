"""pooling.pool_before_conv: a 1x1 conv then an average pool runs as the pool then the
conv (exact), in both flavours, at odd sizes; pools counting their padding, 3x3 convs and
convs read elsewhere stay, with reasons."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.ops import op_kind

from ._helpers import apply_rule, assert_matches, count, reasons

RULE = "pooling.pool_before_conv"


class Transition(nn.Module):
    """DenseNet's transition (BN, ReLU, conv 1x1, AvgPool 2) with stride-2/pad-1 pool not
    counting its padding, a ceil_mode pool, an adaptive pool after a 1x1 conv, an in-place
    ReLU after; refused: a pool counting its padding, a 3x3 conv (not a candidate), a conv
    whose output is read twice."""

    def __init__(self, c: int = 6):
        super().__init__()
        self.bn = nn.BatchNorm2d(c).eval()
        self.conv = nn.Conv2d(c, 4, 1)
        self.pool = nn.AvgPool2d(2)
        self.c2, self.c3 = nn.Conv2d(c, 3, 1, bias=False), nn.Conv2d(c, 5, 1)
        self.c4, self.c5, self.c6 = nn.Conv2d(c, 2, 1), nn.Conv2d(c, 2, 3), nn.Conv2d(c, 2, 1)

    def forward(self, x):
        h = F.relu(self.bn(x))
        a = self.pool(self.conv(h)).relu_()
        b = F.avg_pool2d(self.c2(h), 3, 2, 1, count_include_pad=False)
        c = F.adaptive_avg_pool2d(self.c3(h), (2, 3))
        d = F.avg_pool2d(self.c4(h), 3, 2, 1)  # counts zero padding: refused
        e = F.avg_pool2d(self.c5(h), 2, ceil_mode=True)  # 3x3: not a candidate
        y = self.c6(h)
        f = F.avg_pool2d(y, 2, ceil_mode=True) + y[..., :1, :1]  # read twice: refused
        return [t.sum((-2, -1)) for t in (a, b, c, d, e, f)]


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("shape", [(2, 6, 7, 11), (1, 6, 8, 9)])
def test_pool_before_conv_commutes_and_says_why_not(method, shape):
    model = Transition().eval()
    x = torch.randn(*shape)
    cap, plan, applied = apply_rule(model, (x,), RULE, method, exactness="exact")
    assert count(plan, RULE) == 3, plan.misses
    why = reasons(plan, RULE)
    assert "counts its zero padding" in why and "also read by" in why
    fresh = torch.randn(*shape)
    with torch.no_grad():
        for w, g in zip(model(fresh), applied.gm(fresh), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # the conv of the first site now reads the pool
    convs = [n for n in applied.gm.graph.nodes if op_kind(n) == "conv"]
    assert sum(op_kind(n.args[0]) in ("avg_pool", "adaptive_avg_pool") for n in convs) == 3


def test_pool_before_conv_at_other_batch_sizes_and_saves_flops():
    model = nn.Sequential(nn.Conv2d(8, 4, 1), nn.AvgPool2d(2)).eval()
    x = torch.randn(3, 8, 10, 6)
    cap, plan, applied = apply_rule(model, (x,), RULE, exactness="exact")
    (d,) = plan.decisions
    assert d.estimate.flops_saved > 0 and (d.estimate.time_saved_s or 0) > 0
    assert_matches(model, cap, applied.gm, (x,))
