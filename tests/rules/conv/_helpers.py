"""Shared by the tests of the lossy conv rules: convs whose weight the method can
represent (so that the rule fires), planning one rule in fx and export captures, the
lossy verification at other input sizes, and a plan's JSON round trip."""

from __future__ import annotations

import copy
import json

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import Plan, apply_plan, make_plan
from opswap.verify.metrics import compare
from opswap.verify.tolerance import Tolerance


class Net(nn.Module):
    """conv (the site) -> ReLU -> a 1x1 conv, so the site's output feeds another layer."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv = conv
        self.head = nn.Conv2d(conv.out_channels, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)))


def planned(model: nn.Module, x: torch.Tensor, rule: str, method: str = "fx"):
    """(plan, applied) of `rule` alone on `model` at the example `x`; the model's weights
    are checked unchanged."""
    before = copy.deepcopy(model.state_dict())
    cap = capture(model, (x,), method=method)
    plan = make_plan(cap, rules=[rule], exactness="lossy", keep_slower=True)
    applied = apply_plan(cap, plan)
    assert not plan.failed and not applied.failed, (plan.failed, applied.failed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return cap, plan, applied


def fired(plan, rule: str) -> int:
    return sum(d.rule == rule for d in plan.decisions)


def reasons(plan, rule: str) -> str:
    return " | ".join(m.reason for m in plan.misses if m.rule == rule)


def assert_lossy_ok(model: nn.Module, candidate, shapes: list[tuple[int, ...]]) -> None:
    """The candidate passes the lossy tolerance against the user's module at each shape."""
    tol = Tolerance.for_exactness("lossy")
    for shape in shapes:
        x = torch.randn(*shape)
        with torch.no_grad():
            want, got = model(x), candidate(x)
        assert got.shape == want.shape, (shape, got.shape, want.shape)
        ok, why = tol.check(compare(want, got))
        assert ok, (shape, why)


def assert_round_trip(cap, plan, applied, x: torch.Tensor) -> None:
    """plan.json re-applied to the capture gives the same model."""
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    replay = apply_plan(cap, again)
    with torch.no_grad():
        torch.testing.assert_close(replay.gm(x), applied.gm(x), rtol=1e-5, atol=1e-6)


def convs(gm) -> int:
    """The convolutions the graph runs: nn.Conv2d modules (an fx capture's, and the chains
    installed in their place) and conv calls (an export capture's)."""
    from opswap.graph.ops import op_kind

    mods = sum(isinstance(m, nn.Conv2d) for m in gm.modules())
    calls = sum(n.op == "call_function" and op_kind(n) == "conv" for n in gm.graph.nodes)
    return mods + calls
