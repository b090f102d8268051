"""precision.int8_linear: where it applies and why not, in both capture flavours, that the
result stays inside the approx tolerance at shapes other than the example's, that it is
only planned when approx rules are allowed, and that verification catches a wrong kernel."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import opswap.rules.precision.int8_linear as rule_mod
from opswap import artifact
from opswap.config import OptimizeConfig
from opswap.errors import RuleError
from opswap.graph.capture import capture
from opswap.models import load
from opswap.pipeline import optimize
from opswap.planner import apply_plan, make_plan
from opswap.rules.precision._int8_module import Int8Linear
from opswap.targets.base import Target

from .._shapes import other_shapes

RULE = "precision.int8_linear"

# A CPU profile with fixed numbers (int8 at 4x the float32 rate), so that which sites the
# roofline prediction takes does not depend on the machine running the tests.
FIXED = Target(
    name="fixed-cpu",
    description="test profile",
    kind="cpu",
    peak_flops={"float32": 2.5e11, "int8": 1.0e12},
    mem_bandwidth=2.5e10,
    memory_bytes=2**34,
    dtypes=("float32", "int8"),
    dispatch_s=2e-6,
    view_dispatch_s=1e-6,
)


@pytest.fixture
def int8_pays(monkeypatch):
    """For tests of verification and saving: this machine's timing says int8 pays, with the
    `_int_mm` kernel (FBGEMM's, which a CPU without VNNI gets, is tested in
    tests/kernels/test_int8_fbgemm.py)."""
    monkeypatch.setattr(
        rule_mod, "time_on_this_cpu", lambda m, k, n, b, t, timer, *kernel: (2e-3, 1e-3)
    )
    monkeypatch.setattr(rule_mod, "cpu_kernel", lambda: "int_mm")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(768, 1544)
        self.down = nn.Linear(1544, 768, bias=False)
        self.small = nn.Linear(768, 8)  # too few outputs to pay
        self.w = nn.Parameter(torch.randn(1000, 768) * 0.05)  # functional F.linear, a get_attr

    def forward(self, x):
        h = torch.relu(self.up(x))
        y = self.down(h) + x  # residual, in place below: the rewrite must not disturb it
        y.mul_(0.5)
        return torch.nn.functional.linear(y, self.w), self.small(y)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _plan(model, x, method, exactness="approx"):
    cap = capture(model, (x,), method=method)
    plan = make_plan(cap, rules=[RULE], exactness=exactness, target=FIXED)
    return cap, plan, apply_plan(cap, plan)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_applies_to_the_big_linears_and_says_why_not_elsewhere(method):
    torch.manual_seed(0)
    model = MLP().eval()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 16, 768)
    cap, plan, applied = _plan(model, x, method)
    assert len(plan.decisions) == 3, (plan.decisions, plan.skipped)
    assert not plan.failed and not applied.failed
    why = [m.reason for m in plan.misses if m.rule == RULE]
    assert any("768 -> 8 features" in r for r in why), why
    int8 = [m for m in applied.gm.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 3 and all(m.weight_int8.dtype == torch.int8 for m in int8)
    # the user's module is untouched: still float Linears with the same weights
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.up, nn.Linear)
    # right at the example and at other batch / sequence sizes, within the approx budget
    checked = 0
    for label, xs in [("example", (x,)), *other_shapes(cap)]:
        with torch.inference_mode():
            want, got = model(*xs), applied.gm(*xs)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape, label
            assert _rel(g, w) < 0.03, (label, _rel(g, w))
        checked += 1
    assert checked >= 3


def test_not_planned_at_exact_and_the_reason_is_given():
    model = MLP().eval()
    cap = capture(model, (torch.randn(4, 16, 768),), method="fx")
    plan = make_plan(cap, exactness="exact")
    assert not any(d.rule == RULE for d in plan.decisions)
    assert any(RULE in n and "--exactness approx" in n for n in plan.notes), plan.notes
    with pytest.raises(RuleError, match="--exactness approx"):
        make_plan(cap, rules=[RULE], exactness="exact")


def test_too_few_rows_and_non_float32_are_refused_with_reasons():
    model = MLP().eval()
    _, plan, _ = _plan(model, torch.randn(1, 3, 768), "fx")
    assert not plan.decisions
    assert any("3 row(s) at the example shape" in m.reason for m in plan.misses)
    m64 = MLP().double().eval()
    _, plan, _ = _plan(m64, torch.randn(4, 16, 768, dtype=torch.float64), "fx")
    assert not plan.decisions
    assert any("float64" in m.reason for m in plan.misses)


def test_optimize_verifies_against_approx_tolerance_and_saves_the_int8_model(tmp_path, int8_pays):
    import opswap

    torch.manual_seed(1)
    model = MLP().eval()
    x = torch.randn(8, 16, 768)
    r = optimize(
        model,
        (x,),
        OptimizeConfig(
            samples=2, compare="none", exactness="approx", layers=False, measure_rules=False
        ),
    )
    applied = [d for d in r.plan.decisions if d.rule == RULE]
    assert applied and r.verification.passed
    assert r.to_json()["verification"]["tolerance"]["rel_l2_max"] == pytest.approx(0.03)
    r.save(tmp_path)
    loaded = opswap.load_optimized(tmp_path)
    with torch.inference_mode():
        for b in (1, 5):
            xb = torch.randn(b, 16, 768)
            for w, g in zip(model(xb), loaded(xb), strict=True):
                assert _rel(g, w) < 0.03
    from opswap.kernels.int8_linear import cpu_int_mm_fast

    if artifact.saved_kind(r) == "candidate" and cpu_int_mm_fast():
        # the file holds the integer GEMM when opswap's model won (on a CPU with VNNI;
        # without, the kernel is the float32 reference, see kernels/int8_linear.py)
        ep = torch.export.load(tmp_path / "model.pt2")
        assert any("_int_mm" in str(n.target) for n in ep.graph.nodes)


def test_a_wrong_kernel_fails_verification_and_is_rolled_back(monkeypatch, int8_pays):
    import opswap.kernels.int8_linear as k

    real = k._rescale
    monkeypatch.setattr(k, "_rescale", lambda acc, xs, ws, b: real(acc, xs, ws * 1.2, b))
    torch.manual_seed(2)
    model = MLP().eval()
    r = optimize(
        model,
        (torch.randn(8, 16, 768),),
        OptimizeConfig(
            samples=2,
            compare="none",
            exactness="approx",
            layers=False,
            measure_rules=False,
            bench=False,  # rollback and the budget are the point here, not timing
        ),
    )
    assert r.verification.passed  # after rollback
    assert not any(d.rule == RULE for d in r.plan.decisions)
    rolled = [x.to_json() if hasattr(x, "to_json") else x for x in r.rolled_back]
    assert any(x["rule"] == RULE for x in rolled), rolled


def test_bert_base_sized_encoder_keeps_the_approx_budget(int8_pays):
    """hf:bert at full width (768 hidden, one of its layers, random weights) at the example's
    64 rows: the attention and MLP Linears go to int8 and the output keeps the budget."""
    m = load("hf:bert", overrides={"size": "full", "num_hidden_layers": "1"})
    r = optimize(
        m.module,
        m.example_inputs,
        OptimizeConfig(
            samples=2,
            compare="none",
            exactness="approx",
            layers=False,
            measure_rules=False,
            bench=False,  # rollback and the budget are the point here, not timing
        ),
        name="hf:bert",
    )
    n = sum(d.rule == RULE for d in r.plan.decisions)
    assert n >= 4 and r.verification.passed, (n, r.verification)


def test_on_this_cpu_the_prediction_is_the_sites_timing_elsewhere_the_roofline(monkeypatch):
    """Which way the timing goes is a benchmark's business (benchmarks/bench_int8_linear.py
    checks the verdicts against its own timings); here: the `cpu` target's prediction is
    exactly the timing of the site's shape, and another target's is the roofline."""
    from opswap.bench.timing import with_timer
    from opswap.targets import get_target

    asked = []

    def timed(m, k, n, bias, threads, timer, kernel):
        asked.append((m, k, n, bias))
        assert kernel == rule_mod.cpu_kernel()  # the int8 GEMM this CPU would run
        return 3e-3, 1e-3

    monkeypatch.setattr(rule_mod, "time_on_this_cpu", timed)
    model = nn.Sequential(nn.Linear(2048, 1024)).eval()
    cap = capture(model, (torch.randn(4, 64, 2048),), method="fx")
    rule = rule_mod.Int8DynamicLinear()
    site = [f for f in rule.match(cap.gm) if hasattr(f, "key")][0]
    here = rule.predict(cap.gm, site.found, with_timer(get_target("cpu")))
    assert asked == [(256, 2048, 1024, True)]
    assert here.time_saved_s == pytest.approx(2e-3) and "timed at 256 x 2048 -> 1024" in here.note
    roof = rule.predict(cap.gm, site.found, FIXED)
    assert len(asked) == 1 and "int8 GEMM at the target's int8 rate" in roof.note
    # the roofline on the fixed profile: a quarter of the weight bytes and 4x the rate pay here
    assert roof.time_saved_s > 0


def test_inputs_at_ten_thousand_times_the_examples_scale_stay_inside_the_approx_budget():
    from opswap.verify.outputs import verify
    from opswap.verify.samples import extreme_sample

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(768, 1544), nn.ReLU(), nn.Linear(1544, 768)).eval()
    x = torch.randn(4, 16, 768)
    _, plan, applied = _plan(model, x, "fx")
    assert [d.rule for d in plan.decisions] == [RULE, RULE]
    large = extreme_sample(x, scale=1e4)
    v = verify(
        model,
        applied.gm,
        x,
        tolerance="approx",
        samples=2,
        variants=[("1e4 x the example's scale", large), ("batch 1", x[:1])],
    )
    assert v.passed, v.reasons
    with torch.no_grad():  # per-row scales: the error is relative, the scale does not matter
        assert _rel(applied.gm(large[0]), model(large[0])) < 0.03
