"""legalize.matmul_3d: attention's rank-4 matmuls become rank-3 bmm with no expand; a
matmul that broadcasts over the heads is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ._legal import fired, legal, reasons

RULE = "legalize.matmul_3d"


class Scores(nn.Module):
    """Attention's matmuls with 3 heads of 6 made from a Linear (the heads keep one size)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(18, 36)

    def forward(self, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, s, _ = x.shape
        q, k = self.qk(x).view(n, s, 2, 3, 6).permute(2, 0, 3, 1, 4).unbind(0)  # [B, 3, S, 6]
        w = torch.softmax(q @ k.transpose(-2, -1), dim=-1)  # [B, 3, S, S]
        ctx = torch.matmul(w, k)  # [B, 3, S, 6]
        wide = b @ k.transpose(-2, -1)  # [B, 1, S, 6] @ [B, 3, 6, S]: broadcasts, refused
        return ctx, wide


@pytest.mark.parametrize("method", ["fx", "export"])
def test_rank4_matmuls_become_bmm(method):
    model = Scores()
    xs = (torch.randn(2, 7, 18), torch.randn(2, 1, 7, 6))
    plan, applied, err, rel = legal(model, xs, RULE, method)
    assert fired(plan, RULE) == 2
    assert "broadcasts [2, 1] against [2, 3]" in reasons(plan, RULE)
    assert err < 1e-5 and rel < 1e-6
    ep = torch.export.export(applied.gm, xs).run_decompositions()
    expands = [n for n in ep.graph.nodes if "expand" in str(n.target)]
    assert len(expands) == 2  # the refused matmul's alone
