"""layout.cancel_transpose: transpose chains cancel or compose, in both capture flavours,
and refuse where an intermediate is read elsewhere (examples and property tests).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from opswap.graph import op_kind
from opswap.rules import registry
from opswap.rules.base import sites_of

from ._helpers import FLAVOURS, SETTINGS, apply_rule, flavours, keys, reasons, run, shapes


class Transposes(nn.Module):
    def forward(self, x):
        a = x.transpose(1, 2).transpose(1, 2)  # cancels
        b = x.permute(0, 2, 3, 1).permute(0, 3, 1, 2)  # cancels
        c = x.transpose(1, 3).permute(0, 2, 1, 3)  # one permute
        t = x.transpose(2, 3)
        d = t.transpose(2, 3) + t.sum()  # t is read twice: refused
        return a + b + d, c


@pytest.mark.parametrize("method", FLAVOURS)
def test_cancel_transpose(method):
    plan, applied = run(Transposes(), "layout.cancel_transpose", method)
    assert keys(plan) == ["transpose+transpose_1", "permute+permute_1", "transpose_2+permute_2"]
    assert [d.site.data["identity"] for d in plan.decisions] == [True, True, False]
    assert reasons(plan) == [
        "transpose_3's output is also read by sum_1, so transpose_3 and "
        "transpose_4 cannot be merged"
    ]
    kinds = [op_kind(n) for n in applied.gm.graph.nodes]
    assert kinds.count("permute") == 1 and kinds.count("transpose") == 2
    assert all(d.estimate.bytes_saved == 0 for d in plan.decisions)


class PermChain(nn.Module):
    """x.permute / x.transpose steps; the output of step `read_at` is also summed."""

    def __init__(self, steps, read_at):
        super().__init__()
        self.steps, self.read_at = steps, read_at

    def forward(self, x):
        extra = 0
        for i, (kind, dims) in enumerate(self.steps):
            x = getattr(x, kind)(*dims)
            if i == self.read_at:
                extra = x.sum()
        return x + extra


@st.composite
def perm_chains(draw):
    shape = draw(shapes())
    rank = len(shape)
    steps, total = [], list(range(rank))
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            p = list(draw(st.permutations(range(rank))))
            steps.append(("permute", tuple(p)))
        else:
            a, b = draw(st.lists(st.integers(-rank, rank - 1), min_size=2, max_size=2))
            steps.append(("transpose", (a, b)))
            p = list(range(rank))
            p[a % rank], p[b % rank] = b % rank, a % rank
        total = [total[i] for i in p]
    if draw(st.booleans()):  # close the chain with the inverse of what it did so far
        steps.append(("permute", tuple(total.index(i) for i in range(rank))))
    read_at = draw(st.sampled_from([None, *range(len(steps) - 1)]))
    return shape, steps, read_at


@SETTINGS
@given(perm_chains(), flavours)
def test_cancel_transpose_preserves_and_refuses(case, method):
    shape, steps, read_at = case
    model, x = PermChain(steps, read_at), torch.randn(shape)
    plan, applied = apply_rule(model, x, "layout.cancel_transpose", method)
    assert torch.equal(applied.gm(x), model(x))  # views only: bit-identical
    rule = registry.get("layout.cancel_transpose")
    again = rule.match(applied.gm)
    assert not [s for s in sites_of(again) if len(s.nodes) > 1]
    if read_at is not None:
        assert any("is also read by sum" in m.reason for m in plan.misses)
    if read_at is None:  # one chain: at most one permute is left
        assert sum(op_kind(n) in ("permute", "transpose") for n in applied.gm.graph.nodes) <= 1
