"""layout.drop_identity: identity ops and unneeded copies are removed; refusals for in-place
writes and unknown strides.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from opswap.graph import capture, op_kind
from opswap.rules import registry
from opswap.rules.base import misses_of, sites_of

from ._helpers import FLAVOURS, SETTINGS, SHAPE, _flat, apply_rule, flavours, keys, reasons, run


class Identities(nn.Module):
    def __init__(self):
        super().__init__()
        self.idn = nn.Identity()
        self.lin = nn.Linear(13, 13)

    def forward(self, x):
        y = self.lin(self.idn(x)).contiguous()  # already contiguous
        z = x.transpose(1, 2).contiguous()  # a real copy: refused
        w = x.contiguous()  # the caller chooses x's strides: refused
        c = (y * 2).clone()  # nothing writes into it: removed
        t = c.to(torch.float32).float()  # same dtype twice
        a = torch.ops.aten.alias(t)
        return a + 1, z, w, x.clone()  # returning x.clone(): refused


@pytest.mark.parametrize("method", FLAVOURS)
def test_drop_identity(method):
    plan, applied = run(Identities(), "layout.drop_identity", method)
    if method == "fx":
        assert keys(plan) == ["idn", "contiguous", "clone", "to", "float_1", "alias"]
    else:  # torch.export already dropped the Identity and the no-op contiguous calls
        assert keys(plan) == ["clone", "to", "to_1", "alias"]
    why = reasons(plan)
    assert not any("transpose" in r for r in why)  # a real copy is not a near miss
    assert any("would share memory with x" in r for r in why)
    if method == "fx":
        assert any("lays out the model input x" in r for r in why)
    clone = next(d for d in plan.decisions if d.site.key == "clone")
    assert clone.estimate.bytes_saved == 2 * 4 * 3 * 5 * 7 * 13
    x = torch.randn(SHAPE)
    assert _flat(applied.gm(x))[3].data_ptr() != x.data_ptr()  # the kept clone still copies


@pytest.mark.parametrize("method", FLAVOURS)
def test_drop_identity_refuses_in_place_writes(method):
    class Writes(nn.Module):
        def forward(self, x):
            y = (x * 2).clone()
            y.add_(1)
            return y

    captured = capture(Writes(), (torch.randn(SHAPE),), method=method)
    found = registry.get("layout.drop_identity").match(captured.gm)
    assert not sites_of(found)
    assert "writes into tensors in place" in misses_of(found)[0].reason


def test_drop_identity_refuses_unknown_strides():
    class Copy(nn.Module):
        def forward(self, x):
            return (x * 2).contiguous() + 1

    captured = capture(Copy(), (torch.randn(SHAPE),), method="fx")
    mul = next(n for n in captured.gm.graph.nodes if n.name == "mul")
    del mul.meta["tensor_meta"]
    found = registry.get("layout.drop_identity").match(captured.gm)
    assert not sites_of(found)
    assert misses_of(found)[0].reason == (
        "the strides of mul are not known, so contiguous cannot be shown to be a no-op"
    )


_IDENTITY_STEPS = ["identity", "contiguous", "clone", "to", "float", "alias", "transposed"]


class IdentityStack(nn.Module):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.idn = nn.Identity()

    def forward(self, x):
        y = x + 1
        for s in self.steps:
            if s == "identity":
                y = self.idn(y)
            elif s == "to":
                y = y.to(torch.float32)
            elif s == "alias":
                y = torch.ops.aten.alias(y)
            elif s == "transposed":
                y = y.transpose(0, 1).contiguous()  # a real copy: must stay
            else:
                y = getattr(y, s)()
        return y * 3


@SETTINGS
@given(st.lists(st.sampled_from(_IDENTITY_STEPS), min_size=1, max_size=6), flavours)
def test_drop_identity_preserves(steps, method):
    model, x = IdentityStack(steps), torch.randn(4, 5, 7)
    plan, applied = apply_rule(model, x, "layout.drop_identity", method)
    assert torch.equal(applied.gm(x), model(x))
    again = registry.get("layout.drop_identity").match(applied.gm)
    assert not sites_of(again)
    real_copies = [n for n in applied.gm.graph.nodes if op_kind(n) == "contiguous"]
    assert len(real_copies) == steps.count("transposed")
    assert not misses_of(again)  # the copies left are real: no near misses
