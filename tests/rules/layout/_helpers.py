"""Helpers of the layout rule tests: plan and apply one rule, check outputs on fresh inputs (and
at other batch sizes in the property tests) and that the user's model is untouched.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import nn

from opswap.graph import capture
from opswap.planner import apply_plan, make_plan
from opswap.targets import Target

from .._shapes import assert_same_at_other_shapes

SHAPE = (3, 5, 7, 13)


FLAVOURS = ["fx", "export"]


def _target(layout: str) -> Target:
    return Target(
        name="cpu",
        description="test CPU",
        kind="cpu",
        peak_flops={"float32": 1e12},
        mem_bandwidth=50e9,
        memory_bytes=0,
        dtypes=("float32",),
        layout=layout,
    )


NHWC_CPU = _target("channels_last")


NCHW_CPU = _target("contiguous")


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _flat(o)]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _snapshot(model: nn.Module):
    return {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}, [
        m.training for m in model.modules()
    ]


def run(model, rule, method, inputs=None, target=NHWC_CPU):
    """Plan and apply one rule; check outputs on fresh inputs and that the model is untouched."""
    inputs = inputs or (torch.randn(SHAPE),)
    before = _snapshot(model)
    captured = capture(model, inputs, method=method)
    plan = make_plan(captured, rules=[rule], target=target)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    fresh = tuple(torch.randn_like(t) if t.is_floating_point() else t for t in inputs)
    with torch.no_grad():
        for got, want in zip(_flat(applied.gm(*fresh)), _flat(model(*fresh)), strict=True):
            assert got.shape == want.shape
            assert rel_l2(got, want) <= 1e-5
    after = _snapshot(model)
    assert after[1] == before[1]
    for k, (v, stride) in before[0].items():
        assert torch.equal(after[0][k][0], v) and after[0][k][1] == stride, k
    return plan, applied


def keys(plan) -> list[str]:
    return [d.site.key for d in plan.decisions]


def reasons(plan) -> list[str]:
    return [m.reason for m in plan.misses]


TARGET = Target(
    name="cpu",
    description="test CPU",
    kind="cpu",
    peak_flops={"float32": 1e12},
    mem_bandwidth=50e9,
    memory_bytes=0,
    dtypes=("float32",),
    layout="channels_last",
)


SETTINGS = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


flavours = st.sampled_from(["fx", "fx", "export"])  # export captures are slower: fewer


def apply_rule(model, x, rule, method):
    captured = capture(model, (x,), method=method)
    plan = make_plan(captured, rules=[rule], target=TARGET)
    applied = apply_plan(captured, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert_same_at_other_shapes(model, captured, applied.gm)
    return plan, applied


def outputs(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [t for o in out for t in outputs(o)]


def shapes(rank_min=2, rank_max=5):
    return st.lists(st.integers(1, 6), min_size=rank_min, max_size=rank_max)
