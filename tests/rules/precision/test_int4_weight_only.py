"""precision.int4_weight_only: lossy, so planned only at --exactness lossy; fires on the
decode-shaped Linears ahead of INT8 where both are allowed; its error is int4's."""

from __future__ import annotations

import pytest
import torch

from opswap.errors import RuleError
from opswap.graph.capture import capture
from opswap.planner import make_plan
from opswap.rules.precision._lowbit_modules import WeightOnlyLinear

from ._lowbit import block, cpu_as_gpu, plan, worst_error  # noqa: F401

RULE = "precision.int4_weight_only"


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_and_the_error_is_int4s(cpu_as_gpu, method):  # noqa: F811
    model, x = block(), torch.randn(1, 3, 256).bfloat16()
    cap, p, applied = plan(model, x, RULE, method)
    assert len(p.decisions) == 5, (p.decisions, p.misses)
    mods = [m for m in applied.gm.modules() if isinstance(m, WeightOnlyLinear)]
    assert all(m.bits == 4 and m.group_size == 128 for m in mods) and len(mods) == 5
    assert 0.01 < worst_error(model, cap, applied, x) < 0.15


def test_not_planned_at_approx_and_first_where_int8_is_allowed_too(cpu_as_gpu):  # noqa: F811
    cap = capture(block(), (torch.randn(1, 256).bfloat16(),), method="fx")
    with pytest.raises(RuleError, match="--exactness lossy"):
        make_plan(cap, rules=[RULE], exactness="approx", target="h200")
    p = make_plan(cap, rules=["precision.*"], exactness="lossy", target="h200")
    assert {d.rule for d in p.decisions} == {RULE}


def test_refused_on_the_cpu_with_the_reason():
    _, p, _ = plan(block(), torch.randn(1, 256).bfloat16(), RULE)
    assert not p.decisions and any("on the cpu" in m.reason for m in p.misses)
