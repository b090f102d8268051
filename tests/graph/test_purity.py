"""Dead-code elimination keeps in-place writes and stateful calls (issue: every rewrite
deleted `h.mul_(2)` anywhere in the graph)."""

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.capture import capture
from opswap.graph.purity import eliminate_dead_code, is_impure
from opswap.planner import apply_plan, make_plan


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc(x)
        h.mul_(2)  # result unused: h is what is read afterwards
        h = self.drop(h)
        self.act(h)  # in-place module, result unused
        self.bn(h)  # training-mode BatchNorm: updates its running statistics
        return h + 1


def test_in_place_and_stateful_nodes_survive_dce():
    gm = fx.symbolic_trace(InPlace().train())
    names = {n.name for n in gm.graph.nodes}
    eliminate_dead_code(gm)
    kept = {n.name for n in gm.graph.nodes}
    assert {"mul_", "act", "bn"} <= kept == names
    # torch's own pass (on the versions opswap supports) would have dropped mul_
    plain = fx.symbolic_trace(InPlace().eval())
    impure = {n.name for n in plain.graph.nodes if is_impure(n)}
    assert "mul_" in impure and "act" in impure and "bn" not in impure  # eval BN is pure


def test_dropout_removal_keeps_the_in_place_statement():
    m = InPlace().eval()
    x = torch.randn(4, 8)
    captured = capture(m, (x,))
    plan = make_plan(captured, rules=["layout.drop_dropout"])
    assert len(plan.decisions) == 1
    applied = apply_plan(captured, plan)
    assert "mul_" in {n.name for n in applied.gm.graph.nodes}
    with torch.no_grad():
        for xs in (x, torch.randn(1, 8), torch.randn(7, 8)):
            torch.testing.assert_close(applied.gm(xs), m(xs))
