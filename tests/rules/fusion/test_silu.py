import pytest
import torch
from torch import nn

from ._helpers import count, reasons_text, run


class Swish(nn.Module):
    def forward(self, x, y):
        a = x * torch.sigmoid(x)  # fuses
        b = y * x.sigmoid()  # not x * sigmoid(x)
        h = x.exp()
        h.mul_(torch.sigmoid(h))  # in place, h read below (torch.export: a plain mul)
        return a + b + h


@pytest.mark.parametrize("method", ["fx", "export"])
def test_silu_fuses_and_refuses_an_in_place_write_read_later(method):
    plan, err = run(Swish(), (torch.randn(3, 7), torch.randn(3, 7)), ["fusion.silu"], method)
    assert err <= 1e-6 and count(plan, "fusion.silu") == (1 if method == "fx" else 2)
    assert method == "export" or "writes into exp in place" in reasons_text(plan, "fusion.silu")
