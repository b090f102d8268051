"""fusion.parallel_linear: sibling Linears merge into one; property tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ._helpers import METHOD, METHODS, SETTINGS, TOL, check, count, reasons, reasons_text, run


class Attention(nn.Module):
    """Q, K, V projections of one input (K without bias), heads split with .view, plus
    a pair of functional linears and a reader that flattens its slice with .view(-1)."""

    def __init__(self, h: int = 12, heads: int = 3):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h, bias=False), nn.Linear(h, 6)
        self.wa, self.wb = nn.Parameter(torch.randn(7, 6)), nn.Parameter(torch.randn(5, 6))
        self.ba = nn.Parameter(torch.randn(7))
        self.other = nn.Linear(h, h)

    def forward(self, x, w):  # x: [B, S, h], w: [4, 6]
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, -1).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, -1).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
        y = att.transpose(1, 2).reshape(b, s, -1)  # y: [B, S, 6]
        z = F.linear(y, self.wa, self.ba).view(-1)  # a slice cannot .view(-1): made contiguous
        u = F.linear(y, self.wb)
        t = F.linear(y, w)  # non-constant weight: stays apart
        side = (u.sum(-1) + t.sum(-1)).unsqueeze(-1)
        return z.sum() + side + self.other(u.sum(-1, keepdim=True).expand(b, s, h))


@pytest.mark.parametrize("method", METHODS)
def test_parallel_linear_merges_siblings(method):
    make = lambda: (torch.randn(3, 5, 12), torch.randn(4, 6))  # noqa: E731
    plan, applied = check(
        Attention(), make, ["fusion.parallel_linear"], method, {"fusion.parallel_linear": 2}
    )
    sizes = sorted(len(d.site.data["members"]) for d in plan.decisions)
    assert sizes == [2, 3]
    why = reasons(plan, "fusion.parallel_linear")
    assert len(why) == 1 and "not a constant" in why[0] and "cannot merge" in why[0]
    qkv = [d for d in plan.decisions if len(d.site.data["members"]) == 3][0]
    assert "zero bias" in qkv.site.description
    if method == "fx":
        assert isinstance(applied.gm.get_submodule("q_k_v"), nn.Linear)
        assert applied.gm.get_submodule("q_k_v").weight.shape == (30, 12)


@SETTINGS
@given(
    outs=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    hidden=st.integers(1, 11),
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    data=st.data(),
    method=METHOD,
)
def test_parallel_linear_keeps_outputs(outs, hidden, lead, data, method):
    biases = [data.draw(st.booleans()) for _ in outs]
    from_input = data.draw(st.integers(-1, len(outs) - 1))  # -1: all weights constant

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = nn.ModuleList(
                nn.Linear(hidden, o, bias=b) for o, b in zip(outs, biases, strict=True)
            )

        def forward(self, x, w):
            ys = [F.linear(x, w) if i == from_input else lin(x) for i, lin in enumerate(self.lins)]
            return torch.cat([y.sum(-1, keepdim=True) * (i + 1) for i, y in enumerate(ys)], -1)

    x = torch.randn(*lead, hidden)
    plan, err = run(
        M().eval(),
        (x, torch.randn(outs[max(from_input, 0)], hidden)),
        ["fusion.parallel_linear"],
        method,
    )
    assert err <= TOL
    merged = len(outs) - (from_input >= 0)
    assert count(plan, "fusion.parallel_linear") == (merged >= 2)
    if from_input >= 0:
        assert "not a constant" in reasons_text(plan, "fusion.parallel_linear")


class _Qkv(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x) + self.v(x)


@pytest.mark.parametrize("h", [24, 40])
def test_an_edge_delegate_skips_the_merge_its_split_would_copy(h: int) -> None:
    from opswap.graph.capture import capture
    from opswap.planner import make_plan

    cap = capture(_Qkv(h).eval(), (torch.randn(1, 9, h),))
    rule = "fusion.parallel_linear"
    assert count(make_plan(cap, rules=[rule], target="cpu"), rule) == 1
    plan = make_plan(cap, rules=[rule], target="xnnpack")
    assert count(plan, rule) == 0
    why = [s.reason for s in plan.skipped if s.rule == rule]
    assert len(why) == 1 and "on xnnpack the split copies each of the 3 outputs" in why[0], why
