"""precision.autocast: the graph body under torch.autocast(bfloat16) with the outputs cast
back, as one site; it matches the user's module within bfloat16's error at other batch
sizes (with an in-place op, a buffer and softmax in the mix), torch.export keeps the region
and the reloaded file gives the same bits, it refuses next to per-op half sites, and it is
predicted slower where bfloat16 does not pay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan
from opswap.targets.base import Target

from .._shapes import other_shapes

RULE = "precision.autocast"
# bfloat16 at 16x the float32 rate (a GPU's tensor cores), no launch cost: bf16 pays
FAST_BF16 = Target(
    name="fast-bf16",
    description="test profile",
    kind="gpu",
    peak_flops={"float32": 5e13, "bfloat16": 8e14},
    mem_bandwidth=4e12,
    memory_bytes=2**36,
    dtypes=("float32", "bfloat16"),
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(96, 256)
        self.down = nn.Linear(256, 96)
        self.norm = nn.LayerNorm(96)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = self.up(x).relu_()
        y = self.norm(self.down(h) * self.scale + x)
        # a matmul of two activations as an output: bfloat16 inside the region, cast back
        # (with .to, the reloaded file failed torch.export's dtype assertion; torch 2.13)
        scores = y @ y.transpose(-1, -2) / 96**0.5
        return torch.softmax(y, dim=-1), y, scores


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("method", ["fx", "export"])
def test_one_region_matches_the_users_model_and_exports(method, tmp_path):
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 384, 96)  # enough rows that the GEMMs are compute-bound
    cap = capture(model, (x,), method=method)
    plan = make_plan(cap, rules=[RULE], exactness="approx", target=FAST_BF16)
    assert [d.rule for d in plan.decisions] == [RULE]
    gm = apply_plan(cap, plan).gm
    assert "_enter_autocast" in gm.code and "_exit_autocast" in gm.code
    for label, xs in [("example", (x,)), *other_shapes(cap)]:
        with torch.no_grad():
            want, got = model(*xs), gm(*xs)
        for w, g in zip(want, got, strict=True):
            assert g.dtype == torch.float32, label  # outputs keep their dtype
            assert g.shape == w.shape
            assert 0 < _rel(g, w) < 0.03, (label, _rel(g, w))  # bfloat16 ran, within budget
    ep = torch.export.export(gm, (x,))
    assert any("wrap_with_autocast" in str(n.target) for n in ep.graph.nodes)
    torch.export.save(ep, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    with torch.no_grad():
        for a, b in zip(loaded(x), gm(x), strict=True):
            assert torch.equal(a, b)


def test_refused_beside_per_op_half_sites_and_slower_without_bf16():
    model = Net().eval()
    cap = capture(model, (torch.randn(2, 384, 96),), method="fx")
    plan = make_plan(cap, rules=["precision.bf16", RULE], exactness="approx", target=FAST_BF16)
    rules = [d.rule for d in plan.decisions]
    assert "precision.bf16" in rules and RULE not in rules
    assert any("already runs in low precision" in m.reason for m in plan.misses)
    # a target with no bfloat16 rate: predicted slower, skipped with the reason
    plain = Target(
        name="no-bf16", description="t", kind="gpu", peak_flops={"float32": 5e13},
        mem_bandwidth=4e12, memory_bytes=2**36, dtypes=("float32",),
    )  # fmt: skip
    plan = make_plan(cap, rules=[RULE], exactness="approx", target=plain)
    assert not plan.decisions
    assert any("predicted slower" in s.reason for s in plan.skipped)
    assert not make_plan(cap, exactness="exact").decisions or all(
        d.rule != RULE for d in make_plan(cap, exactness="exact").decisions
    )
