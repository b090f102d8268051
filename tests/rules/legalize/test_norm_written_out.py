"""legalize.norm_written_out: nn.LayerNorm, F.layer_norm and nn.RMSNorm written out with the
4-D mean, so XNNPACK's profile takes every op; a norm over two dims is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ._legal import fired, legal, outside, reasons

RULE = "legalize.norm_written_out"


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(13)
        self.rms = nn.RMSNorm(13, eps=1e-6)
        self.ln2 = nn.LayerNorm((5, 13))
        with torch.no_grad():
            for p in self.parameters():
                p.uniform_(0.5, 1.5)
        self.register_buffer("w", torch.rand(13) + 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            self.ln(x),
            self.rms(x * 2.0),
            F.layer_norm(y, (13,), self.w, None, 1e-3),
            self.ln2(x),
        )


@pytest.mark.parametrize("method", ["fx", "export"])
def test_norms_are_written_out_for_the_delegate(method):
    model, xs = Norms(), (torch.randn(3, 5, 13) * 4 + 1, torch.randn(7, 13))
    plan, applied, err, rel = legal(model, xs, RULE, method)
    assert fired(plan, RULE) == 3
    assert "normalises over [5, 13]" in reasons(plan, RULE)
    assert err < 1e-4 and rel < 1e-5

    class Legal(nn.Module):  # the three taken, without the refused one
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return applied.gm(x, y)[:3]

    left = outside(Legal(), xs)
    assert not left & {"native_layer_norm", "layer_norm", "rms_norm", "mean"}, left
