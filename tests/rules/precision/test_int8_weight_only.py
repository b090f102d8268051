"""precision.int8_weight_only: fires on the decode-shaped Linears (both capture flavours),
keeps outputs within the approx budget at other shapes, and says why not on the CPU, on
many rows and on float32."""

from __future__ import annotations

import pytest
import torch

from opswap.rules.precision._lowbit_modules import WeightOnlyLinear

from ._lowbit import block, cpu_as_gpu, plan, worst_error  # noqa: F401

RULE = "precision.int8_weight_only"


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_on_few_rows_and_stays_within_approx(cpu_as_gpu, method):  # noqa: F811
    model, x = block(), torch.randn(2, 2, 256).bfloat16()
    cap, p, applied = plan(model, x, RULE, method, exactness="approx")
    assert len(p.decisions) == 5, (p.decisions, p.misses, p.skipped)
    mods = [m for m in applied.gm.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(mods) == 5 and all(m.bits == 8 and m.qweight.dtype == torch.int8 for m in mods)
    assert all(d.estimate.time_saved_s > 0 for d in p.decisions)  # h200: half the bytes
    assert isinstance(model.q, torch.nn.Linear)  # the user's module is untouched
    assert worst_error(model, cap, applied, x) < 0.02


def test_refused_on_the_cpu_with_the_reason():
    _, p, _ = plan(block(), torch.randn(1, 256).bfloat16(), RULE)
    assert not p.decisions
    assert any("on the cpu" in m.reason and "--device cuda" in m.reason for m in p.misses)


def test_refused_on_many_rows_and_on_float32(cpu_as_gpu):  # noqa: F811
    _, p, _ = plan(block(), torch.randn(4, 8, 256).bfloat16(), RULE)
    assert not p.decisions
    assert any("32 rows" in m.reason and "memory-bound" in m.reason for m in p.misses)
    _, p, _ = plan(block().float(), torch.randn(1, 256), RULE)
    assert not p.decisions and any("float32" in m.reason for m in p.misses)
