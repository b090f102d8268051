"""fusion.parallel_conv: sibling convs merge into one (concatenated), branch convs on a
channel split merge into one grouped conv; refusals say why; odd shapes and settings."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import Plan, apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes
from ._helpers import METHODS, check, count, reasons_text, rel_l2, run

RULE = "fusion.parallel_conv"


class Inception(nn.Module):
    """Three 1x1 branches (one without bias), a 3x3 branch with other settings, a
    transposed conv and a functional conv with a weight from the input, all on x; an
    in-place ReLU after one merged conv, and an eval BatchNorm (buffers) after another."""

    def __init__(self, c: int = 5):
        super().__init__()
        self.a = nn.Conv2d(c, 4, 1)
        self.b = nn.Conv2d(c, 6, 1, bias=False)
        self.c = nn.Conv2d(c, 3, 1)
        self.d = nn.Conv2d(c, 4, 3, padding=1)
        self.t = nn.ConvTranspose2d(c, 2, 1)
        self.bn = nn.BatchNorm2d(3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x, w):
        a, b, c = self.a(x), self.b(x), self.bn(self.c(x))
        a = F.relu_(a)  # in place on a slice of the merged output
        d = self.d(x)
        t = self.t(x)
        e = F.conv2d(x, w)  # weight from the input: stays apart
        return torch.cat([a, b, c, d, t, e], 1) * 2


@pytest.mark.parametrize("method", METHODS)
def test_parallel_conv_merges_branches_and_says_why_not(method):
    make = lambda: (torch.randn(3, 5, 7, 11), torch.randn(2, 5, 1, 1))  # noqa: E731
    plan, applied = check(Inception(), make, [RULE], method, {RULE: 1})
    (d,) = plan.decisions
    assert len(d.site.data["members"]) == 3 and d.site.data["form"] == "concat"
    why = reasons_text(plan, RULE)
    assert "not a constant" in why
    assert "kernel 3x3" in why and "same settings" in why
    assert "transposed" in why or method == "export"
    if method == "fx":
        conv = applied.gm.get_submodule("a_b_c")
        assert isinstance(conv, nn.Conv2d) and conv.weight.shape == (13, 5, 1, 1)
    _, err = run(Inception().eval(), make(), [RULE], method)  # batch 1 and other sizes too
    assert err <= 1e-5


class Settings(nn.Module):
    """Convs with stride, padding, dilation and groups on one input, as a parameter set."""

    def __init__(self, cin, outs, k, stride, padding, dilation, groups, bias):
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(cin, o, k, stride, padding, dilation, groups, bias=b)
            for o, b in zip(outs, bias, strict=True)
        )

    def forward(self, x):
        ys = [conv(x) for conv in self.convs]
        return sum(y.float().mean((1,), keepdim=True) * (i + 1) for i, y in enumerate(ys))


CASES = [
    # cin, outs, kernel, stride, padding, dilation, groups, bias, input shape
    (3, (4, 2), 3, 2, 1, 1, 1, (True, False), (1, 3, 7, 11)),
    (4, (6, 2, 4), (3, 1), (1, 2), (2, 0), 2, 2, (True, True, False), (2, 4, 9, 5)),
    (6, (3, 6), 1, 1, 0, 1, 3, (False, True), (3, 6, 5, 5)),
    (4, (4, 8), 3, 1, "same", 1, 4, (True, True), (2, 4, 6, 7)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[2]}s{c[3]}p{c[4]}d{c[5]}g{c[6]}")
@pytest.mark.parametrize("method", METHODS)
def test_parallel_conv_keeps_outputs_at_odd_settings(case, method):
    *args, shape = case
    model = Settings(*args).eval()
    x = torch.randn(*shape)
    cap = capture(model, (x,), method=method)
    # grouped convs pay a gather copy the CPU model may call slower: take it anyway here
    plan = make_plan(cap, rules=[RULE], keep_slower=True)
    applied = apply_plan(cap, plan)
    assert count(plan, RULE) == 1 and not applied.failed, plan.misses
    assert assert_same_at_other_shapes(model, cap, applied.gm, rel=1e-5) >= 1
    z = torch.randn(*shape)
    with torch.no_grad():
        assert rel_l2(model(z), applied.gm(z)) <= 1e-5


class ResNeXt(nn.Module):
    """x -> chunk into 3 channel slices -> a 3x3 conv each -> cat; and a split with
    unequal pieces (refused)."""

    def __init__(self, c: int = 4, groups: int = 1):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Conv2d(c, 6, 3, padding=1, stride=2, groups=groups) for _ in range(3)
        )
        self.p, self.q = nn.Conv2d(2, 3, 1), nn.Conv2d(3, 3, 1)

    def forward(self, x, y):
        parts = torch.chunk(x, 3, dim=1)
        out = torch.cat([conv(parts[i]) for i, conv in enumerate(self.branches)], 1)
        u, v = torch.split(y, [2, 3], 1)
        return out, self.p(u) + self.q(v)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_parallel_conv_turns_branches_into_one_grouped_conv(groups, method):
    make = lambda: (torch.randn(2, 12, 7, 9), torch.randn(2, 5, 3, 4))  # noqa: E731
    plan, applied = check(ResNeXt(groups=groups), make, [RULE], method, {RULE: 1})
    (d,) = plan.decisions
    assert d.site.data["form"] == "grouped" and d.site.data["groups"] == 3 * groups
    assert "not all 4 wide" not in reasons_text(plan, RULE)
    assert "not all 2 wide" in reasons_text(plan, RULE) or "agree" in reasons_text(plan, RULE)
    kinds = [n.target for n in applied.gm.graph.nodes if n.op == "call_function"]
    assert torch.chunk not in kinds


def test_parallel_conv_refuses_an_in_place_write_between_the_members():
    class Between(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

        def forward(self, x):
            a = self.a(x).relu_()
            return a + self.b(x)

    cap = capture(Between().eval(), (torch.randn(2, 3, 5, 5),))
    plan = make_plan(cap, rules=[RULE])
    assert count(plan, RULE) == 0 and "in place" in reasons_text(plan, RULE)


def test_parallel_conv_refuses_in_one_sentence():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 4, 3, padding=1)
            self.b = nn.Conv2d(3, 4, 3, padding=1, dilation=1, stride=2)

        def forward(self, x):
            return self.a(x).sum() + self.b(x).sum()

    cap = capture(Two().eval(), (torch.randn(2, 3, 6, 6),))
    plan = make_plan(cap, rules=[RULE])
    assert count(plan, RULE) == 0
    whys = [m.reason for m in plan.misses if m.rule == RULE]
    assert len(whys) == 2  # each names the other
    for why in whys:
        assert "stride (2, 2)" in why and "stride (1, 1)" in why and "." not in why


def test_parallel_conv_plan_round_trips_and_output_is_graph_output():
    class Out(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv1d(3, 2, 3), nn.Conv1d(3, 5, 3)

        def forward(self, x):
            return self.a(x), self.b(x).relu()

    model = Out().eval()
    x = torch.randn(2, 3, 10)
    cap = capture(model, (x,))
    plan = make_plan(cap, rules=[RULE])
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    applied = apply_plan(capture(model, (x,)), again)
    assert count(again, RULE) == 1 and not applied.failed
    for b in (1, 4):
        z = torch.randn(b, 3, 13)
        with torch.no_grad():
            want, got = model(z), applied.gm(z)
        for w_, g_ in zip(want, got, strict=True):
            torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)
