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


class ChannelsLastNorm(nn.Module):
    """ConvNeXt's LayerNorm: over the channels of an image permuted to [N, H, W, C]."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.ln = nn.LayerNorm(c, eps=1e-6)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(self.conv(x).permute(0, 2, 3, 1))
        return y.permute(0, 3, 1, 2)


@pytest.mark.parametrize("shape", [(2, 12, 6, 5), (1, 8, 7, 3)])
def test_a_rank_4_norm_over_channels_is_written_out(shape):
    from opswap.graph.capture import capture

    from ..activation._act import run

    model, xs = ChannelsLastNorm(shape[1]), (torch.randn(*shape) * 3 + 1,)
    cap = capture(model, xs, dynamic="batch")  # H is written into the rewrite: kept fixed
    plan, applied, err, rel = run(model, xs, [RULE], target="xnnpack", captured=cap)
    assert fired(plan, RULE) == 1
    assert err < 1e-4 and rel < 1e-5
    assert "native_layer_norm" in outside(model, xs)
    left = outside(applied.gm, xs)
    assert not left & {"native_layer_norm", "layer_norm", "mean"}, left


def test_a_rank_4_norm_whose_rows_vary_is_refused():
    from opswap.graph.capture import capture
    from opswap.planner import make_plan

    model, xs = ChannelsLastNorm(4), (torch.randn(2, 4, 6, 5),)
    cap = capture(model, xs, dynamic="auto")
    plan = make_plan(cap, rules=[RULE], target="xnnpack")
    if fired(plan, RULE):  # the capture kept the image's height fixed: nothing to refuse
        pytest.skip("this capture claims no dynamic height")
    assert "a rank-4 norm writes its size" in reasons(plan, RULE)
