"""layout.drop_dropout: eval-mode dropout is removed, training-mode dropout refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from opswap.graph import capture, op_kind
from opswap.planner import apply_plan, make_plan

from ._helpers import FLAVOURS, NHWC_CPU, SETTINGS, SHAPE, TARGET, _flat, flavours, run


class Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop1 = nn.Dropout(0.2)
        self.block = nn.Sequential(nn.Linear(13, 13), nn.Dropout(0.3))
        self.drop2d = nn.Dropout2d(0.1)

    def forward(self, x):
        y = self.block(self.drop1(x))
        y = F.dropout(y, 0.5, training=self.training)
        return F.dropout(self.drop2d(y), 0.0) + 1  # p = 0 is removed even in training


@pytest.mark.parametrize("method", FLAVOURS)
def test_drop_dropout(method):
    plan, applied = run(Dropouts().eval(), "layout.drop_dropout", method)
    assert len(plan.decisions) == 5 and not plan.misses
    assert not [n for n in applied.gm.graph.nodes if op_kind(n) == "dropout"]


@pytest.mark.parametrize("method", FLAVOURS)
def test_drop_dropout_refuses_training_mode(method):
    model = Dropouts().eval()
    model.drop1.train()
    captured = capture(model, (torch.randn(SHAPE),), method=method)
    plan = make_plan(captured, rules=["layout.drop_dropout"], target=NHWC_CPU)
    assert len(plan.decisions) == 4
    assert len(plan.misses) == 1
    assert plan.misses[0].reason.startswith("Dropout drop1 is in training mode")
    applied = apply_plan(captured, plan)
    x = torch.randn(SHAPE)
    torch.manual_seed(0)
    want = model(x)
    torch.manual_seed(0)  # the dropout kept draws the same mask from the same generator
    assert torch.equal(_flat(applied.gm(x))[0], want)


class DropoutStack(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.drops = nn.ModuleList(nn.Dropout(p) for _, _, p in spec)
        for d, (_, train, _) in zip(self.drops, spec, strict=True):
            d.train(train)

    def forward(self, x):
        for d, (functional, train, p) in zip(self.drops, self.spec, strict=True):
            x = F.dropout(x, p, training=train) if functional else d(x)
            x = x * 1.5
        return x


@SETTINGS
@given(
    st.lists(
        st.tuples(st.booleans(), st.booleans(), st.sampled_from([0.0, 0.25, 0.5])),
        min_size=1,
        max_size=5,
    ),
    flavours,
)
def test_drop_dropout_counts(spec, method):
    model, x = DropoutStack(spec), torch.randn(3, 5, 7)
    captured = capture(model, (x,), method=method)
    plan = make_plan(captured, rules=["layout.drop_dropout"], target=TARGET)
    in_training = sum(1 for _, train, p in spec if train and p > 0)
    assert len(plan.decisions) == len(spec) - in_training
    assert len(plan.misses) == in_training
    assert all("is in training mode" in m.reason for m in plan.misses)
    applied = apply_plan(captured, plan)
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)  # removed dropouts drew no random numbers: masks line up
    assert torch.equal(applied.gm(x), want)
