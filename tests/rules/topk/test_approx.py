"""topk.approx: torch.topk -> the bucketed opswap::approx_topk at approx exactness only, with
recall@k measured on random rows in the plan (>= 0.95), skipped on a CPU target (measured
slower there); refuses where no bucket split keeps
the recall (short rows, k close to n), another dim; at other shapes (a row length the
buckets do not divide) the op falls back to the exact top-k."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan
from opswap.rules.topk.approx import measured_recall

RULE = "topk.approx"


class Scores(nn.Module):
    def forward(self, x):
        a = torch.topk(x, 8)  # fires
        b = torch.topk(x[..., :24], 20)  # k close to n: refused
        c = torch.topk(x, 2, dim=0)  # another dim: refused
        return a.values, a.indices, b[0], c[0]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_with_its_recall_and_refuses_with_reasons(method):
    torch.manual_seed(0)
    m = Scores()
    x = torch.randn(6, 2048)
    cap = capture(m, (x,), method=method)
    with pytest.raises(Exception, match="add --exactness approx"):
        make_plan(cap, rules=[RULE])  # approx: left out of an exact plan, which says so
    cpu = make_plan(cap, rules=[RULE], exactness="approx")  # measured slower on a CPU
    assert not cpu.decisions and "slower than torch.topk on a CPU" in cpu.skipped[0].reason
    p = make_plan(cap, rules=[RULE], exactness="approx", target="h200")
    applied = apply_plan(cap, p)
    assert not p.failed and not applied.failed
    assert [d.rule for d in p.decisions] == [RULE], (p.decisions, p.misses)
    rec = p.decisions[0].site.data
    assert (
        rec["recall"] >= 0.95
        and rec["buckets"] > 1
        and "recall@8" in p.decisions[0].site.description
    )
    why = " | ".join(mi.reason for mi in p.misses if mi.rule == RULE)
    assert "no split of a row of 24" in why and "the kernel takes the last dim" in why, why
    want, got = m(x), applied.gm(x)
    assert torch.equal(want[2], got[2]) and torch.equal(want[3], got[3])
    assert torch.equal(x.gather(-1, got[1]), got[0])  # real values, where they are
    hits = torch.zeros_like(x, dtype=torch.bool).scatter_(1, want[1], True).gather(1, got[1])
    assert hits.float().mean() >= 0.8  # 6 rows: the plan's 64-row figure is the budget's
    x2 = torch.randn(3, 2047)  # another length: exact
    assert torch.equal(m(x2)[0], applied.gm(x2)[0])


def test_measured_recall_is_a_share():
    r = measured_recall(4096, 16, True, 512, 1)
    assert 0.95 <= r <= 1.0
    assert measured_recall(4096, 16, False, 16, 1) < 0.9  # 16 maxima cannot hold a top-16
