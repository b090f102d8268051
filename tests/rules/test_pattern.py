"""rules/pattern.py: one pattern over op kinds matches every spelling in both capture
flavours, binds repeated names to one tensor, takes mul's operands in either order, and
reads op settings (beta, eps) however they are spelled, refusing a mismatch by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph import capture, op_kind
from opswap.rules._matching import NO_SETTING, setting
from opswap.rules.base import Refused
from opswap.rules.pattern import Match, const, op, var

SWISH = op("mul", var("x"), op("sigmoid", var("x")))
AFFINE = op("add", op("mul", var("x"), const("w")), const("b"))


class Spellings(nn.Module):
    def __init__(self):
        super().__init__()
        self.sig = nn.Sigmoid()
        self.w = nn.Parameter(torch.randn(5))

    def forward(self, x, y):
        a = x * torch.sigmoid(x)
        b = self.sig(y) * y  # operands swapped, a module's sigmoid
        c = x * torch.sigmoid(y)  # not the same tensor: no match
        d = (x * self.w) + 2.0
        return a + b + c + d


@pytest.mark.parametrize("method", ["fx", "export"])
def test_one_pattern_matches_every_spelling_and_binds_repeats(method):
    c = capture(Spellings(), (torch.randn(3, 5), torch.randn(3, 5)), method=method)
    muls = [n for n in c.gm.graph.nodes if op_kind(n) == "mul"]
    hits = [m for m in (SWISH.match(c.gm, n) for n in muls) if m is not None]
    assert len(hits) == 2
    for m in hits:
        assert [op_kind(n) for n in m.nodes] == ["sigmoid", "mul"]
        assert m.nodes[0].args[0] is m["x"]
    adds = [m for m in (AFFINE.match(c.gm, n) for n in c.gm.graph.nodes) if m is not None]
    assert len(adds) == 1 and adds[0]["b"] == 2.0 and adds[0]["w"].shape == (5,)
    assert [op_kind(n) for n in adds[0].nodes] == ["mul", "add"]


class Settings(nn.Module):
    """Softplus with beta 1 spelled four ways (module, default, positional, keyword), one
    with beta 2, and layer norms whose eps a pattern binds."""

    def __init__(self):
        super().__init__()
        self.sp = nn.Softplus()
        self.sp2 = nn.Softplus(beta=2.0)
        self.ln = nn.LayerNorm(7, eps=1e-3)

    def forward(self, x):
        a = self.sp(x) * x + F.softplus(x) * x + F.softplus(x, 1.0) * x
        b = F.softplus(x, beta=1.0) * x + self.sp2(x) * x
        return a + b + self.ln(x) + F.layer_norm(x, (7,))


SOFTPLUS_TIMES_X = op("mul", op("softplus", var("x"), beta=1.0), var("x"))
LN_EPS = op("layer_norm", var("x"), eps=var("eps"))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_settings_match_every_spelling_and_a_mismatch_is_refused_naming_it(method):
    c = capture(Settings(), (torch.randn(3, 4, 7),), method=method)
    muls = [n for n in c.gm.graph.nodes if op_kind(n) == "mul"]
    answers = [SOFTPLUS_TIMES_X.check(c.gm, n) for n in muls]
    assert sum(isinstance(a, Match) for a in answers) == 4
    refused = [a for a in answers if isinstance(a, Refused)]
    assert len(refused) == 1 and "beta=2.0, not 1.0" in refused[0].reason
    assert all(
        SOFTPLUS_TIMES_X.match(c.gm, n) is None for n, a in zip(muls, answers, strict=True) if not a
    )
    norms = [n for n in c.gm.graph.nodes if op_kind(n) == "layer_norm"]
    assert sorted(LN_EPS.match(c.gm, n)["eps"] for n in norms) == [1e-5, 1e-3]


def test_a_setting_the_op_does_not_take_is_refused_and_settings_read_through_modules():
    c = capture(Settings(), (torch.randn(2, 7),), method="fx")
    sp = next(n for n in c.gm.graph.nodes if n.target == "sp2")
    assert setting(sp, "beta") == 2.0 and setting(sp, "threshold") == 20.0
    assert setting(sp, "dim") is NO_SETTING
    refused = op("softplus", var("x"), dim=1).check(c.gm, sp)
    assert isinstance(refused, Refused) and "has no setting 'dim'" in refused.reason
    # a near miss is only one where everything else matched: a wrong op kind is no candidate
    assert op("relu", var("x"), beta=1.0).check(c.gm, sp) is None
