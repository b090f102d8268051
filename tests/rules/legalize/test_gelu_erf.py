"""legalize.gelu_erf: GELU written out with erf becomes one gelu op, in both spellings of
the half and in both capture flavours; an erf that is not GELU's is left, with reasons."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ._legal import fired, legal, outside, reasons

RULE = "legalize.gelu_erf"


class Written(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(7, 19), nn.Linear(19, 7)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.up(x)
        a = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))  # half first
        b = h * (1.0 + torch.erf(h * (1 / math.sqrt(2.0)))) * 0.5  # half last
        e = torch.erf(x / math.sqrt(2.0))
        c = x * (1.0 + e) * 0.5 + e  # the erf is read twice: refused
        return self.down(a), self.down(b), c


@pytest.mark.parametrize("method", ["fx", "export"])
def test_written_gelu_becomes_one_op_at_odd_shapes(method):
    model, x = Written(), torch.randn(3, 5, 7)
    plan, applied, err, rel = legal(model, (x,), RULE, method)
    assert fired(plan, RULE) == 2
    assert "1 + erf alone" in reasons(plan, RULE)
    assert err < 1e-5 and rel < 1e-6
    before = outside(model, (x,))
    assert "erf" in before
    with torch.no_grad():
        ops = {str(n.target) for n in applied.gm.graph.nodes}
    assert sum("gelu" in o for o in ops) >= 1


def test_an_erf_that_is_not_gelu_is_not_a_candidate():
    class Plain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.erf(x) * 2.0

    plan, _, err, _ = legal(Plain(), (torch.randn(2, 9),), RULE)
    assert fired(plan, RULE) == 0 and reasons(plan, RULE) == "" and err == 0.0
