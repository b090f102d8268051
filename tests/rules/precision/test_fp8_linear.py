"""precision.fp8_linear: fires on prefill-sized Linears whose features are multiples of
16, and says why not on few rows, odd features and hardware without FP8."""

from __future__ import annotations

import pytest
import torch

from opswap.kernels import fp8_linear as fp8
from opswap.rules.precision._lowbit_modules import FP8Linear

from ._lowbit import COMPUTE_BOUND, block, cpu_as_gpu, plan, worst_error  # noqa: F401

RULE = "precision.fp8_linear"


@pytest.fixture
def fp8_here(cpu_as_gpu, monkeypatch):  # noqa: F811
    monkeypatch.setattr(fp8, "fp8_supported", lambda device, rowwise=True: None)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_on_many_rows_and_refuses_odd_features(fp8_here, method):
    model, x = block(), torch.randn(2, 80, 256).bfloat16()  # 160 rows
    cap, p, applied = plan(model, x, RULE, method, exactness="approx", target=COMPUTE_BOUND)
    assert len(p.decisions) == 4, (p.decisions, p.misses, p.skipped)
    assert any("multiples of 16" in m.reason for m in p.misses)
    assert len([m for m in applied.gm.modules() if isinstance(m, FP8Linear)]) == 4
    assert worst_error(model, cap, applied, x) < 0.08  # e4m3 on both operands


def test_refused_on_few_rows_and_without_fp8(fp8_here):
    _, p, _ = plan(block(), torch.randn(16, 256).bfloat16(), RULE)
    assert not p.decisions
    assert any("16 rows" in m.reason and "memory-bound" in m.reason for m in p.misses)


def test_small_gemms_are_predicted_slower_on_the_h200(fp8_here):
    _, p, _ = plan(block(), torch.randn(2, 80, 256).bfloat16(), RULE, exactness="approx")
    assert not p.decisions and len(p.skipped) == 4
    assert all("predicted slower on h200" in s.reason for s in p.skipped)


def test_refused_on_the_cpu_with_the_reason(cpu_as_gpu):  # noqa: F811
    _, p, _ = plan(block(), torch.randn(256, 256).bfloat16(), RULE)
    assert not p.decisions
    assert any("FP8 GEMMs need a CUDA GPU" in m.reason for m in p.misses), p.misses
