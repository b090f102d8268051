"""fusion.linear_bn: folds a BatchNorm1d on a 2-D Linear output, refuses 3-D; property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ._helpers import METHOD, METHODS, SETTINGS, TOL, _bn, _eval_bn, check, count, reasons, run


class LinearBNs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(13, 17), _bn(nn.BatchNorm1d, 17)
        self.fc2, self.bn2 = nn.Linear(17, 6, bias=False), _bn(nn.BatchNorm1d, 6)
        self.fc3, self.bn3 = nn.Linear(7, 7), _bn(nn.BatchNorm1d, 6)  # on [N, C=6, L=7]

    def forward(self, x):
        y = self.bn2(self.fc2(torch.relu(self.bn(self.fc(x)))))
        z = self.bn3(self.fc3(y.unsqueeze(2).expand(-1, 6, 7)))
        return y + z.mean(2)


@pytest.mark.parametrize("method", METHODS)
def test_linear_bn_folds_2d_and_refuses_3d(method):
    plan, _ = check(
        LinearBNs(),
        lambda: (torch.randn(3, 13),),
        ["fusion.linear_bn"],
        method,
        {"fusion.linear_bn": 2},
    )
    why = reasons(plan, "fusion.linear_bn")
    assert len(why) == 1 and "3-D" in why[0] and "not the Linear's output features" in why[0]


@SETTINGS
@given(
    n=st.integers(2, 5),
    fin=st.integers(1, 17),
    fout=st.integers(1, 17),
    bias=st.booleans(),
    refuse=st.sampled_from(["", "", "training", "shared"]),
    method=METHOD,
)
def test_linear_bn_keeps_outputs(n, fin, fout, bias, refuse, method):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(fin, fout, bias=bias), _eval_bn(nn.BatchNorm1d, fout)

        def forward(self, x):
            y = self.fc(x)
            return self.bn(y) + (y if refuse == "shared" else 0)

    m = M().eval()
    if refuse == "training":
        m.bn.train()
    plan, err = run(m, (torch.randn(n, fin),), ["fusion.linear_bn"], method)
    assert err <= TOL
    assert count(plan, "fusion.linear_bn") == (0 if refuse else 1)
