"""The stages of one optimize run, each returning its typed value: the capture settles the
target and the tolerance once, plan-and-verify rolls back what breaks the budget and
remembers it for every later plan, pruning and the race stand aside without timing."""

import pytest
import torch
from torch import nn

from opswap.config import OptimizeConfig
from opswap.graph import op_kind
from opswap.rules import registry
from opswap.rules.base import Found, Rule
from opswap.stages import Checked, Pruned, Run, capture_stage, plan_and_verify, prune, race
from opswap.targets import Target
from opswap.verify.tolerance import tolerance_for


class _Scale(Rule):
    """Claims to be exact but scales the first activation by 1.01."""

    name = "test.stage_scale"
    family = "test"
    chapter = 3
    exactness = "exact"

    anchors = ("relu",)

    def check(self, gm, n):
        first = next(m for m in gm.graph.nodes if op_kind(m) == "relu")
        return Found((n,), "scale by 1.01") if n is first else None

    def rewrite(self, gm, found):
        node = found.nodes[0]
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.mul, (node, 1.01))
        node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)


@pytest.fixture(autouse=True)
def scale_rule():
    registry.register(_Scale)
    yield
    registry._RULES.pop(_Scale.name, None)


def _run(**settings) -> Run:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    config = OptimizeConfig(rules=[_Scale.name], bench=False, layers=False, **settings)
    return capture_stage(model, (torch.randn(3, 16),), config, "toy", lambda stage: None)


def test_capture_settles_the_target_and_the_tolerance_for_the_later_stages():
    run = _run(budget="max_abs<=1")
    assert isinstance(run.target, Target) and run.target.name == "cpu"
    assert run.tolerance == tolerance_for("exact", "max_abs<=1", run.captured.rounding)
    assert run.replan().settings.target == run.target.name


def test_plan_and_verify_rolls_back_and_later_plans_leave_the_site_out():
    run = _run()
    checked = plan_and_verify(run, lambda stage: None)
    assert isinstance(checked, Checked) and checked.verification.passed
    assert not checked.applied.applied and len(checked.rolled_back) == 1
    assert list(run.excluded_sites) == [(_Scale.name, checked.rolled_back[0].decision.site.key)]
    assert not run.replan().decisions  # the rolled-back site stays out of every new plan


def test_without_timing_prune_keeps_the_plan_and_there_is_no_race():
    run = _run(rollback=False)
    checked = plan_and_verify(run, lambda stage: None)
    assert not checked.verification.passed and len(checked.applied.applied) == 1
    pruned = prune(run, checked, lambda stage: None)
    assert isinstance(pruned, Pruned) and pruned.attribution is None
    assert pruned.plan is checked.plan and pruned.applied is checked.applied
    assert race(run, pruned, lambda stage: None) is None
