"""What the embedding rule tests share: a model with bags of several tables (of different
rows and widths, sum and mean, weighted, a padding_idx, an nn.EmbeddingBag), and a plan
checked against the user's module at the example's shapes and at others."""

from __future__ import annotations

import copy

import torch
from torch import nn

from opswap.graph.calibrate import Calibration, attach
from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes


class Tables(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.t = nn.ModuleList([nn.Embedding(n, 8) for n in (50, 31, 70)])
        self.pad = nn.Embedding(23, 8, padding_idx=0)
        with torch.no_grad():
            self.pad.weight[0] = 0.5  # the padding row is read like any other
        self.narrow = nn.Embedding(40, 6)
        self.bag = nn.EmbeddingBag(20, 8, mode="sum")

    def forward(self, i, j, k, w):
        a = self.t[0](i).sum(1) + self.t[1](j).sum(dim=1) + self.bag(k)  # sums of width 8
        b = self.pad(k).sum(1)  # joins them
        c = (self.t[2](i) * w.unsqueeze(-1)).sum(1)  # weighted sum
        d = self.narrow(j).mean(1)  # width 6, mean: alone
        e = self.t[1](k).max(1).values  # not a sum or mean: not a bag
        return a * b, c, d, e


def inputs(batch: int = 4, bag: int = 5) -> tuple:
    g = torch.Generator().manual_seed(batch * bag)
    return (
        torch.randint(0, 20, (batch, bag), generator=g),
        torch.randint(0, 23, (batch, bag), generator=g),
        torch.randint(0, 20, (batch, bag), generator=g),
        torch.rand(batch, bag, generator=g),
    )


def plan(model, args, rules, method, exactness="exact", rel=1e-5):
    before = copy.deepcopy(model.state_dict())
    cap = capture(model, args, method=method)
    p = make_plan(cap, rules=rules, exactness=exactness)
    applied = apply_plan(cap, p)
    assert not p.failed and not applied.failed, (p.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert_same_at_other_shapes(model, cap, applied.gm, rel=rel)
    return p, applied


def fired(p, rule: str) -> list:
    return [d for d in p.decisions if d.rule == rule]


def ops(gm, name: str) -> int:
    return sum(name in str(n.target) for n in gm.graph.nodes if n.op == "call_function")


class Clicks(nn.Module):
    def __init__(self, vocab: int, small: int = 500):
        super().__init__()
        torch.manual_seed(0)
        self.ids = nn.Embedding(vocab, 8)
        self.small = nn.Embedding(small, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids, other):
        return self.head(self.ids(ids).sum(1) + self.small(other % 500).sum(1))


def samples(n: int, high: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, high, (64, 4), generator=g), torch.randint(0, 500, (64, 4), generator=g))
        for _ in range(n)
    ]


def lossy(model, rule, samples, calibrate=False):
    cap = capture(model, samples[0], method="fx")
    if calibrate:
        attach(cap.gm, Calibration(samples=list(samples)))
    p = make_plan(cap, rules=[rule], exactness="lossy")
    applied = apply_plan(cap, p)
    assert not p.failed and not applied.failed
    return p, applied


def check_tables_shrink(method: str, rule: str, ratio: int, rel: float) -> None:
    """`rule` stores the bags' tables `ratio` times smaller (int8 adds 8 bytes a row for
    its scale and bias), says so in each site's description, and stays within `rel`."""
    bags = ["embedding.bag", "embedding.batched"]
    m = Tables().eval()
    p, _ = plan(m, inputs(), [*bags, rule], method, exactness="approx", rel=rel)
    got = fired(p, rule)
    assert len(got) == 3, (p.decisions, p.misses)  # the batched group, weighted, mean
    for d in got:
        rec = d.site.data
        extra = 8 * rec["rows"] if ratio == 4 else 0
        assert rec["bytes_after"] == rec["bytes_before"] // ratio + extra, rec
        assert " -> " in d.site.description and "float32" in d.site.description
