"""topk.sort_slice: sort + [:k] (values, indices, both), argsort + [:k] with a gather of the
sorted tensor and of another one -> torch.topk, in both capture flavours, at the example's
shapes and at others (a row shorter than k included, where the slice clamps); values
identical with ties and NaN; refuses a stable sort whose indices are used, a head read
whole as well, values and indices cut at different k, and a slice that keeps every entry."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes

RULE = "topk.sort_slice"


def _plan(model, inputs, method):
    before = copy.deepcopy(model.state_dict())
    cap = capture(model, inputs, method=method)
    p = make_plan(cap, rules=[RULE])
    applied = apply_plan(cap, p)
    assert not p.failed and not applied.failed, (p.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return p, applied, cap


def _topks(gm) -> int:
    return sum(n.op == "call_function" and "topk" in str(n.target) for n in gm.graph.nodes) + sum(
        n.op == "call_method" and n.target == "topk" for n in gm.graph.nodes
    )


def _sorts(gm) -> int:
    return sum("sort" in str(n.target) for n in gm.graph.nodes if n.op != "placeholder")


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(11, 11)

    def forward(self, x, y):
        h = self.lin(x)
        v, i = torch.sort(h, dim=-1, descending=True)
        a = v[..., :3]  # values and indices: fires
        b = i[:, :, :3]
        j = torch.argsort(h, dim=2)[..., :4]  # argsort, gathered from h and from y
        g = torch.gather(y, 2, j)
        s = torch.gather(h, 2, j)
        t = h.sort(1)[0][:, :2]  # another dim, values only
        return a, b, g, s, t


@pytest.mark.parametrize("method", ["fx", "export"])
def test_heads_become_topk_at_every_shape(method):
    torch.manual_seed(0)
    m = Heads().eval()
    x, y = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    p, applied, cap = _plan(m, (x, y), method)
    assert sum(d.rule == RULE for d in p.decisions) == 3, (p.decisions, p.misses)
    assert _topks(applied.gm) == 3 and _sorts(applied.gm) == 0
    with torch.no_grad():
        for w, o in zip(m(x, y), applied.gm(x, y), strict=True):
            assert torch.equal(w, o)
    assert assert_same_at_other_shapes(m, cap, applied.gm, rel=0.0) >= 2


class Ties(nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=-1, descending=True)[0][:, :5], x.sort(-1)[0][:, :4]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_values_identical_with_ties_nan_and_inf(method):
    x = torch.randint(-3, 4, (6, 33)).float()  # many ties
    x[0, 3] = float("nan")
    x[1, :5] = float("-inf")
    x[2, 7] = float("inf")
    m = Ties()
    p, applied, _ = _plan(m, (x,), method)
    assert sum(d.rule == RULE for d in p.decisions) == 2
    for w, o in zip(m(x), applied.gm(x), strict=True):
        assert torch.equal(w.nan_to_num(9.0), o.nan_to_num(9.0))
        assert torch.equal(w.isnan(), o.isnan())


class Near(nn.Module):
    def forward(self, x):
        v, i = torch.sort(x, dim=-1, stable=True)
        a = torch.gather(x * 2, 1, i[:, :3])  # a stable sort's indices used: refused
        s = torch.sort(x, descending=True)
        b = s.values[:, :3] + s.values.sum(-1, keepdim=True)  # head and whole: refused
        u, w = torch.sort(x + 1, dim=-1)
        c = u[:, :2], w[:, :3]  # different k: refused
        d = torch.sort(x - 1)[0][:, :40]  # keeps all 9: refused
        e = torch.sort(x * 3)[0][:, -2:]  # the tail: not a candidate
        f = torch.sort(x - 2, stable=True)[0][:, :2]  # stable, values only: fires
        return a, b, c, d, e, f


@pytest.mark.parametrize("method", ["fx", "export"])
def test_near_misses_say_why(method):
    x = torch.randn(4, 9)
    m = Near()
    p, applied, _ = _plan(m, (x,), method)
    assert sum(d.rule == RULE for d in p.decisions) == 1, (p.decisions, p.misses)
    why = " | ".join(mi.reason for mi in p.misses if mi.rule == RULE)
    assert "stable sort and its indices are used" in why, why
    assert "also read whole" in why and "different k" in why and "nothing to save" in why, why
    for w, o in zip(
        torch.utils._pytree.tree_leaves(m(x)),
        torch.utils._pytree.tree_leaves(applied.gm(x)),
        strict=True,
    ):
        assert torch.equal(w, o)
