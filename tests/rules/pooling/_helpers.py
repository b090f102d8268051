"""Helpers of the pooling rule tests: plan one rule on a capture and apply it, and compare
the result with a model built by hand at the example's shapes and at others."""

from __future__ import annotations

import copy
import json

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import Plan, apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes


def apply_rule(model: nn.Module, inputs: tuple, rule: str, method: str = "fx", exactness="lossy"):
    """(captured, plan, applied) for `rule` alone; the plan goes through JSON and back
    first (plan.json round trip), and the user's module must come out untouched."""
    before = copy.deepcopy(model.state_dict())
    cap = capture(model, inputs, method=method)
    plan = make_plan(cap, rules=[rule], exactness=exactness, keep_slower=True)
    plan = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    applied = apply_plan(cap, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return cap, plan, applied


def assert_matches(expected: nn.Module, cap, gm, inputs: tuple, rel: float = 1e-5) -> None:
    """`gm` computes what `expected` does at fresh inputs of the example's shapes and at
    the other sizes the capture claims."""
    fresh = tuple(torch.randn_like(t) for t in inputs)
    with torch.no_grad():
        want, got = expected(*fresh), gm(*fresh)
    assert want.shape == got.shape
    torch.testing.assert_close(got, want, rtol=rel, atol=rel)
    assert_same_at_other_shapes(expected, cap, gm, rel=rel)


def count(plan, rule: str) -> int:
    return sum(d.rule == rule for d in plan.decisions)


def reasons(plan, rule: str) -> str:
    return " | ".join(m.reason for m in plan.misses if m.rule == rule)
