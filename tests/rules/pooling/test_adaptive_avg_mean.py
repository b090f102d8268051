"""pooling.adaptive_avg_mean: a global average pool becomes a mean (the flatten after it
folded), in 1d/2d/3d and both capture flavours; pools to other sizes are left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.ops import op_kind

from ._helpers import apply_rule, assert_matches, count, reasons

RULE = "pooling.adaptive_avg_mean"
METHODS = ("fx", "export")


class Head(nn.Module):
    """conv -> in-place ReLU -> AdaptiveAvgPool2d((1, 1)) -> flatten (folded); a functional
    pool to 1 whose 4-d output is kept; a pool to (1, None) (refused); a pool to 3 (not a
    candidate); an eval BatchNorm (buffers)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1, stride=2)
        self.bn = nn.BatchNorm2d(6).eval()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)), inplace=True)
        a = self.pool(h).flatten(1)  # [N, 6]
        b = F.adaptive_avg_pool2d(h, 1)  # [N, 6, 1, 1]
        c = F.adaptive_avg_pool2d(h, (1, None)).sum((-2, -1))
        d = F.adaptive_avg_pool2d(h, 3).flatten(1).sum(-1, keepdim=True)
        return a + b.squeeze(-1).squeeze(-1) + c + d


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(2, 3, 7, 11), (1, 3, 5, 5)])
def test_adaptive_avg_mean_fires_and_folds_the_flatten(method, shape):
    model = Head().eval()
    x = torch.randn(*shape)
    cap, plan, applied = apply_rule(model, (x,), RULE, method, exactness="exact")
    assert count(plan, RULE) == 2
    assert method == "export" or "keeps a dim" in reasons(plan, RULE)  # export fills in W
    folded = [d for d in plan.decisions if "flatten" in d.site.description]
    assert len(folded) == 1
    kinds = [op_kind(n) for n in applied.gm.graph.nodes]
    assert kinds.count("adaptive_avg_pool") == 2 and kinds.count("mean") == 2
    assert_matches(model, cap, applied.gm, (x,))


@pytest.mark.parametrize("rank", [1, 3])
def test_adaptive_avg_mean_in_1d_and_3d(rank):
    pool = nn.AdaptiveAvgPool1d(1) if rank == 1 else nn.AdaptiveAvgPool3d(1)
    model = nn.Sequential(pool, nn.Flatten()).eval()
    x = torch.randn(3, 4, *([5, 3, 2][:rank]))
    cap, plan, applied = apply_rule(model, (x,), RULE, exactness="exact")
    assert count(plan, RULE) == 1
    assert_matches(model, cap, applied.gm, (x,))
