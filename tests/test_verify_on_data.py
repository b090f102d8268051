"""With calibration data given, verification judges on the user's data (batches held out
of calibration where there are enough, else the same ones) and on random inputs held
inside that data's range; random samples like the example are checked too and reported
apart. A correctly calibrated int8 model then passes where far-out-of-range random
inputs would fail it, and a badly calibrated one still fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opswap.rules.precision._timing as timing
from opswap.kernels import int8_static
from opswap.pipeline import OptimizeConfig, optimize
from opswap.stages import HOLD_OUT_FROM, held_out

pytestmark = pytest.mark.skipif(
    not int8_static.onednn_available(), reason="onednn's int8 kernels need an x86 CPU torch"
)


class TinyCNN(nn.Module):
    """Image in, feature map out (no class scores: judged by its errors alone)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 6, 3)

    def forward(self, x):
        # contiguous: the int8 convolution writes channels-last (a caller's .view() of the
        # model's output would otherwise fail verification, whatever the ranges)
        return self.c2(torch.relu(self.c1(x))).contiguous()


@pytest.fixture(autouse=True)
def int8_pays(monkeypatch):
    """int8 timed as paying, whatever this machine's timing says (a benchmark's business)."""
    monkeypatch.setattr(timing, "timed_pair", lambda key, timer, make: (2e-3, 1e-3))


def _images(n: int, batch: int, scale: float = 1.0, seed: int = 1) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(batch, 1, 11, 9, generator=g) * scale,) for _ in range(n)]


def _run(data, example, **kw):
    torch.manual_seed(0)
    config = OptimizeConfig(
        exactness="approx",
        rules=["precision.int8_static_*"],
        bench=False,
        layers=False,
        samples=2,
        **kw,
    )
    return optimize(TinyCNN().eval(), (example,), config, calibration_data=data)


def _int8(result) -> list[str]:
    return [s.rule for s in result.applied if s.rule.startswith("precision.int8_static_")]


def test_calibrated_on_data_passes_on_it_where_random_inputs_fail():
    example = torch.randn(4, 1, 11, 9) * 4  # a random example far outside the data's [0, 1]
    r = _run(_images(8, 4), example)
    assert len(_int8(r)) == 3 and not r.rolled_back
    assert r.verification.passed
    assert (
        r.verified_on
        == "2 batches from calibration_data held out of calibration (it ran on the other 6)"
    )
    assert r.plan.calibration is not None and r.plan.calibration.samples == 6
    # the same int8 model on random inputs like the example: clipped far outside its ranges
    assert r.random_check is not None and not r.random_check.passed
    data = r.to_json()
    assert data["verification"]["on"] == r.verified_on and data["verification"]["passed"]
    assert data["verification_random"]["judged"] is False
    assert data["verification_random"]["passed"] is False
    # verified at the other batch sizes the capture claims, cut from the user's batch
    assert any(s.startswith("batch 1") for s in r.verification.shapes)


def test_without_the_data_the_same_plan_fails_on_random_inputs():
    example = torch.randn(3, 1, 11, 9) * 4
    r = _run(_images(8, 3), example, rollback=False)
    assert r.verification.passed and len(_int8(r)) == 3
    check = r.random_check  # the verdict the run would have reached without the data
    assert check is not None and not check.passed
    assert any("rel_l2" in why or "cosine" in why for why in check.reasons)


def test_a_badly_calibrated_model_still_fails_on_the_held_out_data():
    example = torch.rand(4, 1, 11, 9)
    bad = _images(6, 4, scale=0.1) + _images(2, 4, seed=2)  # calibrated on a tenth of the range
    r = _run(bad, example, rollback=False)
    assert len(_int8(r)) == 3 and not r.verification.passed
    assert r.verified_on.startswith("2 batches from calibration_data held out")
    rolled = _run(bad, example)  # with rollback, the int8 sites that break it are taken out
    assert rolled.verification.passed and len(rolled.rolled_back) >= 1
    assert len(_int8(rolled)) < 3


def test_with_few_batches_it_verifies_on_the_batches_calibration_ran_on():
    r = _run(_images(3, 5), torch.rand(5, 1, 11, 9) * 0.5 + 0.25)
    assert r.verification.passed and len(_int8(r)) == 3
    assert r.verified_on == (
        "the 3 batches from calibration_data calibration ran on (fewer than 8, so none was "
        "held out)"
    )
    assert r.plan.calibration.samples == 3
    assert r.verification.samples >= 3 + 1  # the batches, then a random draw within range


def test_held_out_takes_the_last_quarter_from_eight_batches_up():
    batches = [(torch.full((1,), float(i)),) for i in range(12)]
    cal, check, said = held_out(batches, "x.pt")
    assert HOLD_OUT_FROM == 8 and cal == batches[:9] and check == batches[9:]
    assert said == "3 batches from x.pt held out of calibration (it ran on the other 9)"
    cal, check, said = held_out(batches[:7], "x.pt")
    assert cal == check == batches[:7] and "fewer than 8" in said


def test_an_exact_run_keeps_its_random_verification():
    torch.manual_seed(0)
    r = optimize(
        TinyCNN().eval(),
        (torch.randn(2, 1, 11, 9),),
        OptimizeConfig(bench=False, layers=False, samples=2),
        calibration_data=_images(8, 2),
    )
    assert r.verified_on is None and r.random_check is None and r.check_data is None
    assert r.to_json()["verification"]["on"] == "the example and random samples like it"
