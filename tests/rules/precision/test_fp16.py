"""precision.fp16: refused, with the reason naming precision.bf16, where a value at the
example comes near float16's range, while bf16 takes the same layer; what fp16 shares with
bf16 (sites, casts, the cast cleanup, refusals) is tested in test_bf16.py, which runs both."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .test_bf16 import _plan


class Loud(nn.Module):
    """One Linear whose output reaches tens of thousands at the example: float16 overflows
    there, bfloat16 does not."""

    def __init__(self):
        super().__init__()
        self.small = nn.Linear(16, 32)
        self.loud = nn.Linear(32, 8)
        with torch.no_grad():
            self.loud.weight.mul_(3e3)

    def forward(self, x):
        return self.loud(torch.relu(self.small(x))).softmax(-1)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fp16_is_refused_where_the_example_exceeds_its_range_and_bf16_takes_it(method):
    torch.manual_seed(2)
    model = Loud().eval()
    x = torch.randn(5, 16) * 30
    _, plan, applied = _plan(model, (x,), method, "precision.fp16")
    why = [m.reason for m in plan.misses if m.rule == "precision.fp16"]
    assert len(plan.decisions) == 1 and len(why) == 1, (plan.decisions, why)
    assert "beyond float16's range" in why[0] and "precision.bf16" in why[0], why
    with torch.inference_mode():
        assert torch.isfinite(applied.gm(x)).all()
    _, plan, _ = _plan(model, (x,), method, "precision.bf16")
    assert len(plan.decisions) == 2 and not plan.misses
