"""softmax.stable_softmax: the unsafe exp(x) / sum(exp(x)) becomes the safe kernel (approx,
so only in an approx plan): same values where the original is finite, the right answer
where its exp overflows; the user's module is left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opswap.errors import RuleError
from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan

from .._shapes import assert_same_at_other_shapes

RULE = "softmax.stable_softmax"


class Unsafe(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.randn(19))

    def forward(self, x):
        x = x + self.bias
        e = x.exp()
        s = torch.exp(x - x.amax(-1, keepdim=True))  # safe: not this rule's
        return e / e.sum(-1, keepdim=True) + s / s.sum(-1, keepdim=True)


def test_replaces_only_the_unsafe_form_and_fixes_its_overflow():
    torch.manual_seed(5)
    m = Unsafe().eval()
    before = copy.deepcopy(m.state_dict())
    x = torch.randn(2, 7, 19)
    cap = capture(m, (x,))
    with pytest.raises(RuleError, match="exactness approx"):  # an exact plan leaves it out
        make_plan(cap, rules=[RULE], target="h200")
    p = make_plan(cap, rules=[RULE], target="h200", exactness="approx")
    assert [d.site.data["form"] for d in p.decisions] == ["unsafe"], (p.decisions, p.misses)
    applied = apply_plan(cap, p)
    assert not applied.failed
    assert_same_at_other_shapes(m, cap, applied.gm, rel=1e-5)
    big = torch.randn(2, 7, 19) + 100.0  # exp overflows: the original is NaN there
    with torch.no_grad():
        assert torch.isnan(m(big)).any()
        out = applied.gm(big)
    assert torch.allclose(out, 2 * torch.softmax(big + m.bias, -1), atol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
