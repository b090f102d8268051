"""precision.int8_static_linear on an MLP of its own: per-channel and per-tensor weights,
symmetric and asymmetric inputs, an in-place op between the layers, against the user's
module at other batch and sequence sizes; the layers opswap installed are left alone.
(The rule beside the convolutions, export and saving: test_int8_static_conv.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opswap.graph.calibrate import Calibration, attach
from opswap.graph.capture import capture
from opswap.kernels import int8_static
from opswap.planner import apply_plan, make_plan
from opswap.rules.precision._int8_static_module import Int8StaticLinear
from opswap.verify.samples import make_samples

from .._shapes import other_shapes
from .test_int8_static_conv import FIXED

pytestmark = pytest.mark.skipif(
    not int8_static.onednn_available(), reason="onednn's int8 kernels need an x86 CPU torch"
)
RULE = "precision.int8_static_linear"


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 768)
        self.down = nn.Linear(768, 256, bias=False)

    def forward(self, x):
        h = self.up(x)
        h.mul_(torch.sigmoid(h))  # in place between the two int8 layers
        return self.down(h) + x


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("symmetric", [False, True])
def test_mlp_in_int8_matches_the_users_module(per_channel, symmetric):
    torch.manual_seed(0)
    model = MLP().eval()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 32, 256)  # 128 rows: int8 pays on the profile
    cap = capture(model, (x,), method="fx")
    attach(cap.gm, Calibration(make_samples((x,), 6), symmetric=symmetric, per_channel=per_channel))
    plan = make_plan(cap, rules=[RULE], exactness="approx", target=FIXED)
    assert len(plan.decisions) == 2, (plan.decisions, plan.misses)
    gm = apply_plan(cap, plan).gm
    mods = [m for m in gm.modules() if isinstance(m, Int8StaticLinear)]
    assert len(mods) == 2 and all(m.per_channel == per_channel for m in mods)
    if not per_channel:
        assert all(bool((m.weight_scale == m.weight_scale[0]).all()) for m in mods)
    for label, xs in [("example", (x,)), *other_shapes(cap)]:
        with torch.inference_mode():
            assert _rel(gm(*xs), model(*xs)) < 0.05, label
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # planning again on the result takes nothing: the int8 layers are opswap's own
    again = capture(gm, (x,), method="fx")
    attach(again.gm, Calibration(make_samples((x,), 2)))
    assert not make_plan(again, rules=[RULE], exactness="approx", target=FIXED).decisions
