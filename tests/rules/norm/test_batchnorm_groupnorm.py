"""norm.batchnorm_groupnorm: an eval BatchNorm in fx and export captures becomes a GroupNorm
whose affine comes from the running statistics; the rewritten graph is that GroupNorm at
other batch and image sizes than the example's (against an nn.GroupNorm model built by
hand); refusals say why; exact and approx plans never take it; it predicts no saving."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.graph.capture import capture
from opswap.graph.ops import op_kind
from opswap.planner import apply_plan, make_plan
from opswap.rules.norm._bn_groupnorm import group_count, scale_shift, stats_init

RULE = "norm.batchnorm_groupnorm"


def _bn(c: int, kind=nn.BatchNorm2d) -> nn.Module:
    bn = kind(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.3, 3)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return bn


class Net(nn.Module):
    """Conv -> BN (24 channels: 24 groups) -> in-place ReLU in a Sequential, a buffer added,
    then F.batch_norm on 12 channels with the buffers as running statistics (12 groups)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1), _bn(24), nn.ReLU(inplace=True))
        self.conv = nn.Conv2d(24, 12, 1)
        self.register_buffer("offset", torch.randn(12, 1, 1))
        self.register_buffer("rm", torch.randn(12))
        self.register_buffer("rv", torch.rand(12) + 0.5)

    def forward(self, x):
        h = self.conv(self.block(x)) + self.offset
        return F.batch_norm(h, self.rm, self.rv, None, None, False, 0.1, 1e-5)


def _gn(c: int, mean, var, eps, weight, bias) -> nn.GroupNorm:
    """The GroupNorm the rule should build, made here from the formula."""
    g = group_count(c)
    s, t = scale_shift(mean, var, eps, weight, bias, c)
    a, b = stats_init(mean, var, s, t, g, eps)
    gn = nn.GroupNorm(g, c, eps=eps)
    with torch.no_grad():
        gn.weight.copy_(a.float())
        gn.bias.copy_(b.float())
    return gn


class Reference(nn.Module):
    """Net with both BatchNorms written as explicit nn.GroupNorm modules."""

    def __init__(self, net: Net):
        super().__init__()
        self.net = copy.deepcopy(net)
        bn = self.net.block[1]
        self.net.block[1] = _gn(24, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias)
        self.gn = _gn(12, net.rm, net.rv, 1e-5, None, None)

    def forward(self, x):
        n = self.net
        return self.gn(n.conv(n.block(x)) + n.offset)


def _plan(model, x, method, exactness="lossy", rules=(RULE, "fusion.*")):
    before = copy.deepcopy(model.state_dict())
    cap = capture(model, (x,), method=method)
    plan = make_plan(cap, rules=list(rules), exactness=exactness)
    applied = apply_plan(cap, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return plan, applied


def fired(plan) -> int:
    return sum(d.rule == RULE for d in plan.decisions)


def reasons(plan) -> str:
    return " | ".join(m.reason for m in plan.misses if m.rule == RULE)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_and_computes_the_groupnorm_at_other_sizes(method):
    torch.manual_seed(0)
    net = Net().eval()
    plan, applied = _plan(net, torch.randn(2, 3, 9, 9), method)
    assert fired(plan) == 2, (plan.decisions, plan.misses)
    assert not any(d.rule == "fusion.conv_bn" for d in plan.decisions)  # it ran first
    kinds = [op_kind(n) for n in applied.gm.graph.nodes]
    assert "batch_norm" not in kinds and kinds.count("group_norm") == 2, kinds
    ref = Reference(net).eval()
    for shape in [(1, 3, 9, 9), (5, 3, 9, 9), (3, 3, 11, 7)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            want, got, bn_out = ref(x), applied.gm(x), net(x)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6
        # and it did change the function: that is what makes it lossy
        assert (got - bn_out).norm() / bn_out.norm() > 1e-3


def test_the_prediction_saves_no_time_and_says_what_it_costs():
    plan, _ = _plan(Net().eval(), torch.randn(2, 3, 9, 9), "fx")
    for d in plan.decisions:
        assert d.estimate.time_saved_s == 0.0
        assert d.estimate.bytes_saved < 0  # GroupNorm reads its input twice
        assert "no speed-up" in d.estimate.note


class TrainBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), _bn(8)

    def forward(self, x):
        return self.bn(self.conv(x))


class Odd(nn.Module):
    """37 channels (a prime above 32) and a BatchNorm1d whose 32 groups hold one value."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 37, 1), _bn(37)
        self.fc, self.bn1 = nn.Linear(37, 32), _bn(32, nn.BatchNorm1d)

    def forward(self, x):
        return self.bn1(self.fc(self.bn(self.conv(x)).mean((2, 3))))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_refusals_say_why(method):
    torch.manual_seed(1)
    plan, _ = _plan(TrainBN().train(), torch.randn(4, 3, 6, 6), method, rules=[RULE])
    assert fired(plan) == 0 and "training mode" in reasons(plan), reasons(plan)
    plan, _ = _plan(Odd().eval(), torch.randn(4, 3, 5, 5), method, rules=[RULE])
    assert fired(plan) == 0
    why = reasons(plan)
    assert "37 channels have no divisor from 2 to 32" in why, why
    assert "would hold one value" in why, why


def test_refuses_a_non_floating_input():
    """A BatchNorm cannot run on integers, so no model produces this; the guard is checked
    on a capture whose recorded dtype is changed."""
    from opswap.rules import registry

    cap = capture(TrainBN().eval(), (torch.randn(2, 3, 6, 6),), method="fx")
    conv = next(n for n in cap.gm.graph.nodes if n.target == "conv")
    meta = conv.meta["tensor_meta"]
    conv.meta["tensor_meta"] = meta._replace(dtype=torch.int32)
    rule = next(r for r in registry.all_rules() if r.name == RULE)
    bn = next(n for n in cap.gm.graph.nodes if n.target == "bn")
    got = rule.check(cap.gm, bn)
    assert "torch.int32; GroupNorm takes floating-point tensors" in got.reason


@pytest.mark.parametrize("exactness", ["exact", "approx"])
def test_exact_and_approx_plans_never_take_it(exactness):
    plan, applied = _plan(
        Net().eval(), torch.randn(2, 3, 9, 9), "fx", exactness, rules=["norm.*", "fusion.*"]
    )
    assert fired(plan) == 0 and any(d.rule == "fusion.conv_bn" for d in plan.decisions)
    assert any(RULE in n for n in plan.notes)  # "lossy rules not considered ..."
    with pytest.raises(RuleError, match="add --exactness lossy"):
        _plan(Net().eval(), torch.randn(2, 3, 9, 9), "fx", exactness, rules=[RULE])
