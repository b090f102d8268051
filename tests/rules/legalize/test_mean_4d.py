"""legalize.mean_4d: a mean over the last dim of a 2-D or 3-D tensor becomes the 4-D mean
XNNPACK takes, with and without keepdim; other means are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ._legal import fired, legal, outside, reasons

RULE = "legalize.mean_4d"


class Means(nn.Module):
    def forward(
        self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        a = x - x.mean(-1, keepdim=True)  # [B, S, H] keepdim
        b = torch.mean(y * 3.0, dim=1)  # [B, H] over the last dim, no keepdim
        c = x.mean(dim=2)  # [B, S]
        d = x.mean(1)  # over the sequence: refused
        e = (z * 2.0).mean((2, 3))  # global average pooling without keepdim
        return a, b, c, d, e


@pytest.mark.parametrize("method", ["fx", "export"])
def test_means_over_the_last_dim_move_into_the_4d_form(method):
    model, xs = Means(), (torch.randn(3, 5, 11), torch.randn(3, 13), torch.randn(3, 4, 5, 7))
    plan, applied, err, rel = legal(model, xs, RULE, method)
    assert fired(plan, RULE) == 4
    assert "averages dims [1] of a rank-3 tensor" in reasons(plan, RULE)
    assert err < 1e-5 and rel < 1e-6
    assert "mean" in outside(model, xs)
    ranks = [
        n.args[0].meta["val"].dim()
        for n in torch.export.export(applied.gm, xs).run_decompositions().graph.nodes
        if "mean" in str(n.target)
    ]
    assert ranks.count(4) == 4
