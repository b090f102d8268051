"""legalize.masked_fill_bias: a causal mask buffer's masked_fill(-inf) becomes an added 0/-inf
bias, bit for bit at every length; another fill value or an input mask is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ._legal import fired, legal, outside, reasons

RULE = "legalize.masked_fill_bias"


class Causal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("future", torch.ones(16, 16, dtype=torch.bool).triu(1))

    def forward(self, s: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = s.size(-1)
        mask = torch.narrow(torch.narrow(self.future, 0, 0, n), 1, 0, n)
        a = s.masked_fill(mask, float("-inf")).softmax(-1)
        b = s.masked_fill(mask, -1e9)  # refused: not exact as a bias
        c = s.masked_fill(m > 0, float("-inf"))  # refused: the mask is an input's
        return a, b, c


@pytest.mark.parametrize("method", ["fx", "export"])
def test_constant_mask_becomes_a_bias(method):
    model = Causal()
    xs = (torch.randn(2, 3, 9, 9), torch.randn(2, 3, 9, 9))
    plan, applied, err, _ = legal(model, xs, RULE, method)
    assert fired(plan, RULE) == 1
    why = reasons(plan, RULE)
    assert "only -inf is exact" in why and "not a constant sliced" in why
    assert err == 0.0

    class Taken(nn.Module):
        def forward(self, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return applied.gm(s, m)[0]

    class Before(nn.Module):
        def forward(self, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return model(s, m)[0]

    assert "where" in outside(Before(), xs) and "where" not in outside(Taken(), xs)
