"""A plan with static int8 decisions keeps its calibration: the scales (per site) and a
record of the settings and of the weights they were observed with. Replayed from
plan.json it remakes the same int8 model with no samples; on other weights, or from a plan
without scales, it refuses in one sentence naming --calibration, unless calibration data
is given (which calibrates again) or the spec offers some; data from a file sets other
ranges than random samples do."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from opswap import api
from opswap.config import OptimizeConfig
from opswap.errors import CalibrationError, PlanError
from opswap.graph.calibrate import Calibration, attach
from opswap.graph.capture import capture
from opswap.kernels import int8_static
from opswap.models._common import CalibrationSource
from opswap.planner import Plan, make_plan
from opswap.rules.precision._int8_static_module import Int8StaticConv2d, Int8StaticLinear
from opswap.stages import calibrate_stage
from opswap.targets.base import Target
from opswap.verify.samples import make_samples

pytestmark = pytest.mark.skipif(
    not int8_static.onednn_available(), reason="onednn's int8 kernels need an x86 CPU torch"
)

RULES = ["fusion.*", "precision.int8_static_*"]
FIXED = Target(  # a profile where int8 pays: the plan does not depend on this CPU's timing
    name="fixed-cpu",
    description="test profile: int8 at 4x the float32 rate",
    kind="cpu",
    peak_flops={"float32": 2.5e11, "int8": 1.0e12},
    mem_bandwidth=2.5e10,
    memory_bytes=2**34,
    dtypes=("float32", "int8"),
    dispatch_s=2e-6,
    view_dispatch_s=1e-6,
)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 24)
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))
        x = torch.relu(self.c2(x))
        return self.head(torch.relu(self.fc(x.mean((2, 3)))))


def _tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    m = Tiny().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


X = torch.randn(4, 3, 11, 9)


def _int8_layers(gm: nn.Module) -> list[nn.Module]:
    return [m for m in gm.modules() if isinstance(m, Int8StaticConv2d | Int8StaticLinear)]


def _plan(model: nn.Module, data) -> Plan:
    return api.plan(
        model, (X,), target=FIXED, rules=RULES, exactness="approx", calibration_data=data
    )


def test_a_file_of_batches_sets_other_ranges_than_random_samples(tmp_path):
    model = _tiny()
    data = torch.rand(12, 3, 11, 9) * 6  # all >= 0 and up to 6: unlike normal samples
    torch.save(data, tmp_path / "cal.pt")
    from_file = _plan(model, tmp_path / "cal.pt")
    cap = capture(model, (X,))
    attach(cap.gm, Calibration(make_samples((X,), 8)))
    from_random = make_plan(cap, target=FIXED, rules=RULES, exactness="approx")

    def first_conv(plan: Plan) -> dict:
        return next(d.site.data for d in plan.decisions if d.rule.endswith("int8_static_conv"))

    f, r = first_conv(from_file), first_conv(from_random)
    # the model's input over the file's 3 batches of 4: [0, max], so zero point 0
    assert f["zero_point"] == 0 and f["scale"] == float(data.max()) / 255
    assert r["zero_point"] > 0 and r["scale"] != f["scale"]  # normal samples go below 0
    rec = from_file.calibration
    assert rec is not None and (rec.samples, rec.source) == (3, "batches from cal.pt")


def test_plan_json_remakes_the_same_int8_model_without_samples(tmp_path):
    model = _tiny()
    data = [(torch.randn(4, 3, 11, 9),) for _ in range(3)]
    plan = _plan(model, data)
    assert sum(d.rule.startswith("precision.int8_static") for d in plan.decisions) >= 3
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path).calibration == plan.calibration  # the record round-trips
    made = api.replay(model, (X,), plan, calibration_data=data)  # as planning made it
    again = api.replay(model, (X,), path)  # from the file alone
    assert again.calibration is not None and "as the plan holds them" in again.calibration
    assert not again.applied.failed
    scales = [(m.x_scale, m.x_zp) for m in _int8_layers(again.applied.gm)]
    assert scales == [(m.x_scale, m.x_zp) for m in _int8_layers(made.applied.gm)]
    x7 = torch.randn(7, 3, 13, 9)  # another batch and height
    with torch.inference_mode():
        assert torch.equal(again.applied.gm(x7), made.applied.gm(x7))


def test_other_weights_or_no_scales_are_refused_naming_the_option(tmp_path):
    model = _tiny()
    data = [(torch.randn(4, 3, 11, 9),) for _ in range(2)]
    path = _plan(model, data).save(tmp_path / "plan.json")
    retrained = _tiny(seed=1)
    with pytest.raises(CalibrationError) as e:
        api.replay(retrained, (X,), path)
    msg = str(e.value)
    assert "observed with other weights" in msg and "--calibration FILE" in msg
    assert "\n" not in msg
    done = api.replay(retrained, (X,), path, calibration_data=data)  # calibrated again
    assert done.calibration is not None and "calibrated on 2 batches" in done.calibration
    assert not done.applied.failed and _int8_layers(done.applied.gm)

    old = json.loads(path.read_text())
    del old["calibration"]  # a plan from before plans kept their calibration
    path.write_text(json.dumps(old))
    with pytest.raises(CalibrationError, match="holds no activation scales"):
        api.replay(model, (X,), path)
    spec = CalibrationSource(lambda: torch.randn(8, 3, 11, 9), "calibration() in tiny.py")
    done = api.replay(model, (X,), path, calibration_fallback=spec)
    assert "2 batches from calibration() in tiny.py" in str(done.calibration)
    assert not done.applied.failed


def test_a_broken_calibration_record_names_its_field(tmp_path):
    path = _plan(_tiny(), [(torch.randn(4, 3, 11, 9),)]).save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    data["calibration"]["method"] = "median"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="calibration.method must be one of minmax"):
        Plan.load(path)


def test_a_plan_without_int8_sites_leaves_calibration_out():
    plan = api.plan(_tiny(), (X,), target=FIXED, rules=["fusion.*"])
    assert plan.calibration is None and "calibration" not in plan.to_json()
    done = api.replay(_tiny(), (X,), plan, calibration_data=[X])
    assert done.calibration == (
        "the calibration data was not used: the plan has no static int8 decision"
    )


def test_calibration_data_at_exact_is_noted_as_unused():
    run = SimpleNamespace(
        config=OptimizeConfig(exactness="exact", bench=False),
        captured=capture(_tiny(), (X,)),
        notes=[],
    )
    calibrate_stage(run, [X], where="my batches")  # type: ignore[arg-type]
    assert run.notes == [
        "Calibration data from my batches was not used: exactness exact plans no static "
        "int8 (exactness approx does)."
    ]
