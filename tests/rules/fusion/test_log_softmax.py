"""fusion.log_softmax: log(softmax) becomes log_softmax, is more accurate, refuses an
implicit dim; property tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from opswap.graph.ops import op_kind

from ._helpers import (
    METHOD,
    METHODS,
    SETTINGS,
    TOL,
    check,
    count,
    fired,
    images,
    optimize,
    reasons,
    run,
)


class LogSoftmaxes(nn.Module):
    def __init__(self):
        super().__init__()
        self.sm = nn.Softmax(dim=1)

    def forward(self, x):
        a = torch.log(torch.softmax(x, -1))
        b = self.sm(x).log()
        p = F.softmax(x * 2, dim=0)
        return a + b + torch.log(p) + p  # p also read directly: softmax kept


@pytest.mark.parametrize("method", METHODS)
def test_log_softmax_replaces_log_of_softmax(method):
    plan, applied = check(
        LogSoftmaxes(), images(3, 13), ["fusion.log_softmax"], method, {"fusion.log_softmax": 3}
    )
    shared = [d for d in plan.decisions if d.site.data["shared"]]
    assert len(shared) == 1 and "stays" in shared[0].site.description
    kinds = [op_kind(n) for n in applied.gm.graph.nodes]
    assert kinds.count("log_softmax") == 3 and kinds.count("softmax") == 1
    assert "log" not in kinds


def test_log_softmax_is_more_accurate_where_softmax_underflows():
    class M(nn.Module):
        def forward(self, x):
            return torch.log(torch.softmax(x, dim=-1))

    x = torch.tensor([[0.0, -200.0, 5.0]])
    _, applied = optimize(M(), (x,), ["fusion.log_softmax"], "fx")
    with torch.no_grad():
        assert torch.isinf(M()(x)).any()
        assert torch.isfinite(applied.gm(x)).all()
        assert torch.allclose(applied.gm(x), torch.log_softmax(x.double(), -1).float())


def test_log_softmax_refuses_an_implicit_dim():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.sm = nn.Softmax()

        def forward(self, x):
            return torch.log(self.sm(x))

    with pytest.warns(UserWarning):
        plan, _ = optimize(M(), (torch.randn(3, 13),), ["fusion.log_softmax"], "fx")
    assert fired(plan, "fusion.log_softmax") == 0
    assert any("implicit dim" in r for r in reasons(plan, "fusion.log_softmax"))


@SETTINGS
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    data=st.data(),
    shared=st.booleans(),
    method=METHOD,
)
def test_log_softmax_keeps_outputs(shape, data, shared, method):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))

    class M(nn.Module):
        def forward(self, x):
            p = torch.softmax(x, dim)
            return torch.log(p) + (p if shared else 0)

    plan, err = run(M().eval(), (torch.randn(*shape) * 3,), ["fusion.log_softmax"], method)
    assert err <= TOL
    assert count(plan, "fusion.log_softmax") == 1
