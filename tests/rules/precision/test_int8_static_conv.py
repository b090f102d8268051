"""precision.int8_static_linear and precision.int8_static_conv: calibrated, they quantise
the layers left after the BatchNorm folds (a ReLU joins its conv), stay inside the approx
budget against the user's module at other batch sizes, with an in-place op and a stateful
module in the mix, in both capture flavours; they refuse without calibration samples and
on small layers, with reasons; the result saves, exports and reloads with its int8 ops;
and the calibration runs the graph once per plan, not once per site."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import opswap.rules.precision._timing as timing
from opswap.config import OptimizeConfig
from opswap.graph.calibrate import Calibration, attach, calibration_of
from opswap.graph.capture import capture
from opswap.kernels import int8_static
from opswap.pipeline import optimize
from opswap.planner import apply_plan, make_plan
from opswap.rules.precision._int8_static_module import Int8StaticConv2d, Int8StaticLinear
from opswap.targets.base import Target
from opswap.verify.samples import make_samples

from .._shapes import other_shapes

pytestmark = pytest.mark.skipif(
    not int8_static.onednn_available(), reason="onednn's int8 kernels need an x86 CPU torch"
)

RULES = ["fusion.*", "precision.int8_static_*"]
FIXED = Target(
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


class Net(nn.Module):
    """Conv+BN+ReLU, a strided conv whose ReLU is in place, a running-count buffer that
    forward updates (stateful), and two Linears, the last too small to quantise."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 64)
        self.head = nn.Linear(64, 10)
        self.register_buffer("offset", torch.tensor(0.25))

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = self.c2(x).relu_()
        x = nn.functional.adaptive_avg_pool2d(x, 4).flatten(1) + self.offset
        return self.head(torch.relu(self.fc(x)))


def _net():
    torch.manual_seed(0)
    m = Net().eval()
    with torch.no_grad():  # a trained-like BatchNorm
        m.b1.running_mean.uniform_(-0.5, 0.5)
        m.b1.running_var.uniform_(0.5, 2.0)
    return m


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _planned(model, x, method="fx", cal_method="minmax", symmetric=False):
    cap = capture(model, (x,), method=method)
    attach(cap.gm, Calibration(make_samples((x,), 6), method=cal_method, symmetric=symmetric))
    plan = make_plan(cap, rules=RULES, exactness="approx", target=FIXED)
    return cap, plan, apply_plan(cap, plan)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_quantises_the_folded_convs_and_the_big_linear(method):
    model = _net()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 12, 12)
    cap, plan, applied = _planned(model, x, method)
    rules = [d.rule for d in plan.decisions]
    assert rules.count("precision.int8_static_conv") == 2, plan.decisions
    assert rules.count("precision.int8_static_linear") == 1, plan.decisions
    assert "fusion.conv_bn" in rules and "fusion.conv_relu" not in rules
    assert any("10 features" in m.reason or "64 -> 10" in m.reason for m in plan.misses)
    convs = [m for m in applied.gm.modules() if isinstance(m, Int8StaticConv2d)]
    assert sorted(c.post for c in convs) == ["relu", "relu"]  # both ReLUs in the epilogue
    assert all(c.weight_int8.dtype == torch.int8 for c in convs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for label, xs in [
        ("example", (x,)),
        *other_shapes(cap),
        ("batch 7", (torch.randn(7, 3, 12, 12),)),
    ]:
        with torch.inference_mode():
            want, got = model(*xs), applied.gm(*xs)
        assert got.shape == want.shape, label
        assert _rel(got, want) < 0.03, (label, _rel(got, want))


@pytest.mark.parametrize("cal", ["minmax", "percentile", "mse", "entropy"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_every_calibration_method_keeps_a_bounded_error(cal, symmetric):
    model = _net()
    x = torch.relu(torch.randn(4, 3, 12, 12))
    _, plan, applied = _planned(model, x, cal_method=cal, symmetric=symmetric)
    assert len(plan.decisions) >= 4
    xt = torch.relu(torch.randn(5, 3, 12, 12))
    with torch.inference_mode():
        assert _rel(applied.gm(xt), model(xt)) < 0.1


def test_calibration_runs_the_graph_once_per_plan():
    model = _net()
    x = torch.randn(4, 3, 12, 12)
    cap = capture(model, (x,), method="fx")
    cal = Calibration(make_samples((x,), 3))
    attach(cap.gm, cal)
    plan = make_plan(cap, rules=RULES, exactness="approx", target=FIXED)
    assert cal.stats_runs == 1  # three sites, one run over the samples
    apply_plan(cap, plan)
    assert cal.stats_runs == 2  # the replay on a fresh copy observes once more
    assert calibration_of(cap.gm) is cal  # copies share the samples, not copy them


def test_refused_without_calibration_and_on_small_layers():
    model = _net()
    cap = capture(model, (torch.randn(2, 3, 12, 12),), method="fx")
    plan = make_plan(cap, rules=["precision.int8_static_*"], exactness="approx", target=FIXED)
    assert not plan.decisions
    assert any("no calibration samples" in m.reason for m in plan.misses), plan.misses
    tiny = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 8)).eval()
    _, plan, _ = _planned(tiny, torch.randn(2, 3, 6, 6))
    assert not [d for d in plan.decisions if d.rule.startswith("precision")]
    reasons = " ".join(m.reason for m in plan.misses)
    assert "2 output channels" in reasons and "-> 8 features" in reasons


def test_modules_round_trip_their_state_dict():
    model = _net()
    _, _, applied = _planned(model, torch.randn(4, 3, 12, 12))
    sd = applied.gm.state_dict()
    assert any(k.endswith("_extra_state") for k in sd)
    fresh = copy.deepcopy(applied.gm)
    for m in fresh.modules():
        if isinstance(m, (Int8StaticConv2d, Int8StaticLinear)):
            m.x_scale, m.x_zp = 1.0, 0
            m.weight_int8.zero_()
    fresh.load_state_dict(sd)
    x = torch.randn(3, 3, 12, 12)
    with torch.inference_mode():
        assert torch.equal(fresh(x), applied.gm(x))


def test_exported_file_keeps_the_int8_ops(tmp_path):
    model = _net()
    x = torch.randn(4, 3, 12, 12)
    _, _, applied = _planned(model, x)
    ep = torch.export.export(applied.gm, (x,))
    targets = {str(n.target) for n in ep.graph.nodes}
    assert any("int8_static_conv2d" in t for t in targets)
    assert any("int8_static_linear" in t for t in targets)
    torch.export.save(ep, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    with torch.inference_mode():
        assert _rel(loaded(x), applied.gm(x)) < 1e-6


def test_optimize_calibrates_verifies_and_saves(tmp_path, monkeypatch):
    import opswap

    # this machine's timing says int8 pays (whether it does is a benchmark's business)
    monkeypatch.setattr(timing, "timed_pair", lambda key, timer, make: (2e-3, 1e-3))
    model = _net()
    x = torch.randn(4, 3, 12, 12)
    data = [(torch.randn(4, 3, 12, 12),) for _ in range(4)]
    r = optimize(
        model,
        (x,),
        OptimizeConfig(
            rules=RULES,
            samples=2,
            compare="none",
            exactness="approx",
            layers=False,
            measure_rules=False,
            calibrate="percentile",
        ),  # fmt: skip
        calibration_data=data,
    )
    assert r.verification.passed
    rules = [d.rule for d in r.plan.decisions]
    assert rules.count("precision.int8_static_conv") == 2, rules
    assert rules.count("precision.int8_static_linear") == 1, rules
    # c1 feeds c2 alone: uint8 handed over, and the saved file keeps it
    assert rules.count("precision.int8_static_handoff") == 1, rules
    r.save(tmp_path)
    loaded = opswap.load_optimized(tmp_path)
    with torch.inference_mode():
        xb = torch.randn(2, 3, 12, 12)
        assert _rel(loaded(xb), model(xb)) < 0.03
    with pytest.raises(Exception, match="calibrate must be one of"):
        OptimizeConfig(calibrate="median")


class _ConvHead(nn.Module):
    """A fully convolutional model whose last op is a conv (a segmentation head), with an
    in-place ReLU between: oneDNN's int8 conv writes channels-last."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 5, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu_(self.c1(x)))


def test_a_conv_at_the_end_returns_the_layout_the_model_does(tmp_path, monkeypatch):
    """Quantising the model's last conv keeps its output contiguous, as the model's is (a
    caller's .view() works), at other sizes and after saving; the rewrite is not rolled back."""
    import opswap

    monkeypatch.setattr(timing, "timed_pair", lambda key, timer, make: (2e-3, 1e-3))
    torch.manual_seed(0)
    model = _ConvHead().eval()
    x = torch.randn(2, 3, 12, 10)
    data = [(torch.randn(2, 3, 12, 10),) for _ in range(4)]
    config = OptimizeConfig(
        rules=RULES, samples=2, compare="none", exactness="approx", layers=False,
        measure_rules=False,
    )  # fmt: skip
    r = optimize(model, (x,), config, calibration_data=data)
    assert r.verification.passed and not r.rolled_back, r.rolled_back
    rules = [d.rule for d in r.plan.decisions]
    assert rules.count("precision.int8_static_conv") == 2, rules
    r.save(tmp_path)
    loaded = opswap.load_optimized(tmp_path)
    for xb in (torch.randn(1, 3, 7, 11), torch.randn(3, 3, 12, 10)):
        with torch.inference_mode():
            got, want = loaded(xb), model(xb)
        assert got.is_contiguous() and got.shape == want.shape
        assert _rel(got, want) < 0.05
        got.view(-1)  # what the caller of the model's output may do
