"""fusion.matmul_add: x @ W + b becomes a linear, refusals with reasons; property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ._helpers import METHOD, METHODS, SETTINGS, TOL, check, count, reasons, reasons_text, run


class MatMulAdds(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(13, 17)), nn.Parameter(torch.randn(17))
        self.w2, self.b2 = nn.Parameter(torch.randn(17, 9)), nn.Parameter(torch.randn(1, 9))
        self.w3 = nn.Parameter(torch.randn(9, 5))
        self.table = nn.Parameter(torch.randn(5, 5))  # [S, N]: not a bias
        self.w4, self.b4 = nn.Parameter(torch.randn(5, 5)), nn.Parameter(torch.randn(5))

    def forward(self, x, w):  # x: [B, S=5, 13]
        y = x @ self.w1 + self.b1
        y = self.b2 + torch.matmul(y, self.w2)
        y = y @ self.w3 + 0.5  # a scalar bias
        y = y @ self.w4.t() + self.table  # bias varies along S: refused
        m = y @ w  # w is a forward argument: refused
        y = m + self.b4
        s = y @ self.w4
        return (s + self.b4) * s  # matmul output read twice: refused


@pytest.mark.parametrize("method", METHODS)
def test_matmul_add_becomes_linear_and_refuses_with_reasons(method):
    plan, applied = check(
        MatMulAdds(),
        lambda: (torch.randn(3, 5, 13), torch.randn(5, 5)),
        ["fusion.matmul_add"],
        method,
        {"fusion.matmul_add": 3},
    )
    why = " | ".join(reasons(plan, "fusion.matmul_add"))
    assert "not a bias along the last dim" in why
    assert "not a constant" in why and "model input w" in why
    assert "also read by" in why
    lin = [n for n in applied.gm.graph.nodes if "linear" in str(n.target)]
    assert len(lin) == 3


@SETTINGS
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    k=st.integers(1, 13),
    n=st.integers(1, 13),
    bias=st.sampled_from(["vec", "row", "scalar", "table", "input_w"]),
    first=st.booleans(),
    method=METHOD,
)
def test_matmul_add_keeps_outputs(lead, k, n, bias, first, method):
    lead = lead or [3]

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(k, n))
            shape = {"vec": (n,), "row": (1, n), "table": (lead[-1], n), "input_w": (n,)}
            self.b = nn.Parameter(torch.randn(*shape.get(bias, (n,))))

        def forward(self, x, w):
            mm = x @ (w if bias == "input_w" else self.w)
            b = 0.25 if bias == "scalar" else self.b
            return b + mm if first else mm + b

    x = torch.randn(*lead, k)
    plan, err = run(M().eval(), (x, torch.randn(k, n)), ["fusion.matmul_add"], method)
    assert err <= TOL
    ok = bias in ("vec", "row", "scalar") or (bias == "table" and lead[-1] == 1)
    assert count(plan, "fusion.matmul_add") == ok
    if not ok:
        assert reasons_text(plan, "fusion.matmul_add")
