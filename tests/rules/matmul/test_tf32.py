"""matmul.tf32: float32 GEMM sites on an Ampere+ CUDA target -> opswap::gemm in TF32, at
--exactness approx only; the candidate verifies within the approx tolerance (on this CPU
the op multiplies in float32; on a GPU, where the product is TF32's, the GPU test checks
the tolerance holds); refused on pre-Ampere targets and for other dtypes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from opswap.errors import RuleError
from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan
from opswap.targets import get_target
from opswap.verify.outputs import verify

from .._shapes import assert_same_at_other_shapes

GEMM = torch.ops.opswap.gemm.default


def _mlp(d: int = 24) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 40), nn.GELU(), nn.Linear(40, 10)).eval()


def _precisions(gm) -> list[str]:
    return [n.args[6] for n in gm.graph.nodes if n.target is GEMM]


def test_plans_tf32_at_approx_and_the_candidate_verifies():
    model, x = _mlp(), torch.randn(6, 24)
    cap = capture(model, (x,))
    p = make_plan(cap, rules=["matmul.*"], target="h200", exactness="approx")
    assert [d.rule for d in p.decisions] == ["matmul.tf32", "matmul.tf32"]
    assert "TF32" in p.decisions[0].estimate.note
    applied = apply_plan(cap, p)
    assert _precisions(applied.gm) == ["tf32", "tf32"]
    result = verify(model, applied.gm, (x,), tolerance="approx")
    assert result.passed, result
    assert_same_at_other_shapes(model, cap, applied.gm, rel=1e-5)  # float32 on a CPU


def test_not_at_exact_and_not_before_ampere():
    model, x = _mlp(), torch.randn(2, 24)
    cap = capture(model, (x,))
    with pytest.raises(RuleError, match="add --exactness approx"):
        make_plan(cap, rules=["matmul.tf32"], target="h200")
    assert not [d for d in make_plan(cap, target="h200").decisions if d.rule == "matmul.tf32"]
    old = dataclasses.replace(get_target("h200"), name="v100-like")
    # a CUDA profile whose device class is not sm80 or later (no TF32 tensor cores)
    p = make_plan(cap, rules=["matmul.tf32"], target=old, exactness="approx")
    assert not p.decisions
    assert all("start at Ampere (sm80)" in s.reason for s in p.skipped), p.skipped


def test_takes_float32_only_and_uses_an_injected_timer():
    model = _mlp().to(torch.bfloat16)
    cap = capture(model, (torch.randn(3, 24, dtype=torch.bfloat16),))
    p = make_plan(cap, rules=["matmul.tf32"], target="a100", exactness="approx")
    assert not p.decisions
    assert "this rule takes float32" in " ".join(m.reason for m in p.misses)
    cap = capture(_mlp(), (torch.randn(3, 24),))
    slow = dataclasses.replace(get_target("a100"), timer=lambda fns: {"cublas": 1.0, "ours": 2.0})
    p = make_plan(cap, rules=["matmul.tf32"], target=slow, exactness="approx")
    assert not p.decisions
    assert "cuBLAS float32 1000000.0 us, opswap::gemm TF32 2000000.0 us" in p.skipped[0].reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 needs a CUDA GPU")
def test_on_a_gpu_the_product_is_tf32_and_within_the_approx_tolerance():
    model, x = _mlp(256).cuda(), torch.randn(64, 256, device="cuda")
    cap = capture(model, (x,))
    p = make_plan(cap, rules=["matmul.tf32"], target="h200", exactness="approx")
    applied = apply_plan(cap, p)
    with torch.no_grad():
        want, got = model(x), applied.gm(x)
    rel = float((got - want).norm() / want.norm())
    assert 1e-6 < rel < 5e-3  # rounded to TF32, not float32's product
    assert verify(model, applied.gm, (x,), tolerance="approx").passed
