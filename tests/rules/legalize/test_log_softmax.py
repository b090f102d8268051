"""legalize.log_softmax: log_softmax over the last dim written out with the 4-D max and mean,
stable where log(softmax) would underflow; a last dim that varies is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ._legal import fired, legal, outside, reasons

RULE = "legalize.log_softmax"


class Heads(nn.Module):
    """Classifier heads: log_softmax over a Linear's 11 and 7 outputs (sizes that stay)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 11), nn.Linear(4, 7)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        h = self.b(y)
        return F.log_softmax(self.a(x) * 60.0, dim=-1), torch.log_softmax(h, 1), z.log_softmax(1)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_log_softmax_written_out_stays_finite(method):
    model, xs = Heads(), (torch.randn(3, 6, 5), torch.randn(3, 4), torch.randn(3, 9))
    plan, applied, err, rel = legal(model, xs, RULE, method)
    assert fired(plan, RULE) == 2
    assert "the last dim of z varies" in reasons(plan, RULE)
    assert rel < 1e-5 and err < 1e-3  # values reach -500: float32's spacing there
    with torch.no_grad():
        got = applied.gm(*xs)[0]
    assert torch.isfinite(got).all()

    class Taken(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple:
            return applied.gm(x, y, z)[:2]

    assert not outside(Taken(), xs), outside(Taken(), xs)
