"""layout.collapse_view: reshape chains become one reshape at every probed shape."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from opswap.graph import op_kind
from opswap.rules import registry
from opswap.rules.base import sites_of

from ._helpers import FLAVOURS, SETTINGS, apply_rule, flavours, keys, run, shapes


class Views(nn.Module):
    def forward(self, x):
        a = x.view(3, 35, 13).reshape(15, 7, 13).flatten(0, 1)  # one reshape
        b = x.reshape(3, 5, 7, 13)  # same shape: removed
        c = x.unsqueeze(0).squeeze(0)  # identity chain: removed
        d = x.view(x.size(0), 35, 13).unsqueeze(1)  # FX: size read at run time
        e = x.flatten(2).view(x.size(0), -1)  # the last op spells the shape: fine
        return a, b + c, d, e


@pytest.mark.parametrize("method", FLAVOURS)
def test_collapse_view(method):
    plan, applied = run(Views(), "layout.collapse_view", method)
    common = ["view+reshape+flatten", "reshape_1", "unsqueeze+squeeze", "flatten_1+view_2"]
    if method == "fx":
        assert keys(plan) == common
        assert len(plan.misses) == 1 and plan.misses[0].where == "unsqueeze_1"
        assert "a size read at run time" in plan.misses[0].reason
    else:  # torch.export fixed x.size(0) to 3 when it traced, so d collapses too
        assert sorted(keys(plan)) == sorted([*common, "view_1+unsqueeze_1"])
        assert not plan.misses
    shape_ops = [
        n for n in applied.gm.graph.nodes if op_kind(n) in ("view", "reshape", "flatten", "squeeze")
    ]
    assert len(shape_ops) == (4 if method == "fx" else 3)


def _factor(n: int, parts: int, draw) -> list[int]:
    dims = []
    for _ in range(parts - 1):
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        d = draw(st.sampled_from(divisors))
        dims.append(d)
        n //= d
    return [*dims, n]


@st.composite
def reshape_chains(draw):
    shape = draw(shapes(2, 4))
    numel = math.prod(shape)
    steps, cur = [], list(shape)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["view", "reshape", "flatten", "unsqueeze", "squeeze"]))
        if kind in ("view", "reshape"):
            cur = _factor(numel, draw(st.integers(1, 4)), draw)
            if draw(st.booleans()):
                spelled = list(cur)
                spelled[draw(st.integers(0, len(cur) - 1))] = -1
                steps.append((kind, spelled))
            else:
                steps.append((kind, list(cur)))
        elif kind == "flatten" and len(cur) > 1:
            a = draw(st.integers(0, len(cur) - 2))
            b = draw(st.integers(a + 1, len(cur) - 1))
            steps.append(("flatten", (a, b)))
            cur = cur[:a] + [math.prod(cur[a : b + 1])] + cur[b + 1 :]
        elif kind == "unsqueeze":
            d = draw(st.integers(0, len(cur)))
            steps.append(("unsqueeze", d))
            cur = cur[:d] + [1] + cur[d:]
        elif kind == "squeeze" and 1 in cur and len(cur) > 1:
            d = cur.index(1)
            steps.append(("squeeze", d))
            cur = cur[:d] + cur[d + 1 :]
    return shape, steps


class ReshapeChain(nn.Module):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def forward(self, x):
        x = x * 2  # the chain starts on a computed, contiguous tensor
        for kind, a in self.steps:
            x = getattr(x, kind)(*a) if isinstance(a, (list, tuple)) else getattr(x, kind)(a)
        return x + 1


@SETTINGS
@given(reshape_chains(), flavours)
def test_collapse_view_preserves(case, method):
    shape, steps = case
    model, x = ReshapeChain(steps), torch.randn(shape)
    plan, applied = apply_rule(model, x, "layout.collapse_view", method)
    assert torch.equal(applied.gm(x), model(x))
    left = [
        n for n in applied.gm.graph.nodes if op_kind(n) in ("view", "reshape", "flatten", "squeeze")
    ]
    assert len(left) <= 1  # the whole chain is one reshape, or gone
    assert not sites_of(registry.get("layout.collapse_view").match(applied.gm))
