"""rules/pattern.py: one pattern over op kinds matches every spelling in both capture
flavours, binds repeated names to one tensor, and takes mul's operands in either order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.graph import capture, op_kind
from opswap.rules.pattern import const, op, var

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
