"""Helpers of the fusion rule tests.

The example tests check every model in both capture flavours (FX leaves and torch.export
ATen), on odd shapes (batch 3, 5 x 7 images, 13 channels), and that the rewritten model
computes the same numbers (relative L2 <= 1e-5 on fresh inputs). The property tests (`run`)
draw random shapes and small graphs and judge a rewrite by the error it adds over a float64
run of the original.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes

METHODS = ("fx", "export")


TOL = 1e-5


def _bn(kind, c: int) -> nn.Module:
    """A BatchNorm with statistics and affine parameters far from the identity."""
    bn = kind(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.3, 3)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return bn


def rel_l2(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((ref - out).norm() / ref.norm()).item()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def optimize(model: nn.Module, inputs: tuple, rules, method: str):
    """Plan and apply `rules` on a capture of `model`; check the user's module is untouched."""
    before = copy.deepcopy(model.state_dict())
    captured = capture(model, inputs, method=method)
    plan = make_plan(captured, rules=rules)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "the user's model was mutated"
    return plan, applied


def fired(plan, rule: str) -> int:
    return sum(d.rule == rule for d in plan.decisions)


def reasons(plan, rule: str) -> list[str]:
    return [m.reason for m in plan.misses if m.rule == rule]


def assert_same(model, applied, make_inputs, samples: int = 2) -> None:
    """Original and rewritten model agree on fresh random inputs."""
    for _ in range(samples):
        inputs = make_inputs()
        with torch.no_grad():
            ref, out = _first(model(*inputs)), _first(applied.gm(*inputs))
        assert ref.shape == out.shape
        assert rel_l2(ref, out) <= TOL


def check(model, make_inputs, rules, method, expect: dict[str, int]):
    model = model.eval()
    plan, applied = optimize(model, make_inputs(), rules, method)
    for rule, n in expect.items():
        assert fired(plan, rule) == n, (rule, [d.site.key for d in plan.decisions], plan.misses)
    assert_same(model, applied, make_inputs)
    for d in plan.decisions:
        assert d.estimate.bytes_saved >= 0, d
    return plan, applied


def images(*shape):
    return lambda: (torch.randn(*shape),)


SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


# export captures cost ~10x an FX trace: one example in four uses it
METHOD = st.sampled_from(["fx", "fx", "fx", "export"])


def _eval_bn(kind, c: int) -> nn.Module:
    return _bn(kind, c).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(model: nn.Module, inputs: tuple, rules, method: str, dynamic: str = "auto"):
    """(plan, worst error the rewrite adds) over two fresh input draws; asserts nothing
    failed, that the user's module was not touched, and that the result matches the
    module at two other sizes along every batch/sequence axis the capture claims. The model comes in the mode to test.

    The error is measured against a float64 run of the original and counted beyond 4x
    the float32 original's own error there, so deep stacks whose BN folds amplify
    rounding (and oneDNN's fused kernels, which sum in another order) are judged by
    what the rewrite adds, not by float32 rounding the original suffers too.
    """
    before = copy.deepcopy(model.state_dict())
    captured = capture(model, inputs, method=method, dynamic=dynamic)
    plan = make_plan(captured, rules=rules)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert_same_at_other_shapes(model, captured, applied.gm)
    truth_model = copy.deepcopy(model).double()
    worst = 0.0
    for _ in range(2):
        fresh = tuple(torch.randn_like(t) if t.is_floating_point() else t for t in inputs)
        with torch.no_grad():
            ref, out = model(*fresh), applied.gm(*fresh)
            truth = truth_model(*(t.double() if t.is_floating_point() else t for t in fresh))
        out = out[0] if isinstance(out, (tuple, list)) else out
        worst = max(worst, _rel(out, truth) - 4 * _rel(ref, truth))
    return plan, worst


def count(plan, rule: str) -> int:
    return sum(d.rule == rule for d in plan.decisions)


def reasons_text(plan, rule: str) -> str:
    return " | ".join(m.reason for m in plan.misses if m.rule == rule)
