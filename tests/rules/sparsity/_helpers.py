"""Helpers of the sparsity rule tests: plan one rule (lossy) and apply it; a target whose
timer returns fixed times, so that "kept only where faster" is tested without timing."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import Plan, apply_plan, make_plan
from opswap.targets import get_target
from opswap.targets.base import Target


def fixed_timer(
    dense_s: float, sparse_s: float
) -> Callable[[dict[str, Callable[[], Any]]], dict[str, float]]:
    """A timer that runs each call once (so it must work) and reports the given times."""

    def timer(calls: dict[str, Callable[[], Any]]) -> dict[str, float]:
        for fn in calls.values():
            fn()
        return {"dense": dense_s, "sparse": sparse_s}

    return timer


def timed_target(name: str, dense_s: float, sparse_s: float) -> Target:
    return dataclasses.replace(get_target(name), timer=fixed_timer(dense_s, sparse_s))


def plan_rule(
    model: nn.Module,
    inputs: tuple,
    rule: str,
    target: Target | str | None = None,
    keep_slower: bool = False,
):
    """(captured, plan, applied) for `rule` alone, through plan.json and back; the user's
    module must come out untouched."""
    before = copy.deepcopy(model.state_dict())
    cap = capture(model, inputs)
    plan = make_plan(cap, rules=[rule], exactness="lossy", target=target, keep_slower=keep_slower)
    plan = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    applied = apply_plan(cap, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return cap, plan, applied


def count(plan, rule: str) -> int:
    return sum(d.rule == rule for d in plan.decisions)


def why(plan, rule: str) -> str:
    return " | ".join(
        [m.reason for m in plan.misses if m.rule == rule]
        + [s.reason for s in plan.skipped if s.rule == rule]
    )
