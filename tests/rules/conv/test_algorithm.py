"""conv.algorithm: the per-site race. A scripted timer makes each candidate win in turn; the
rule must pick it, record every time, leave a site to PyTorch's conv when that wins,
refuse an algorithm too inexact to race, refuse to choose without a timer, and the
rewritten model must match the user's module at the example's shapes and at others."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.graph.capture import capture
from opswap.kernels import conv_algorithms as ca
from opswap.planner import Plan, apply_plan, make_plan
from opswap.report.document import to_markdown
from opswap.report.optimize_report import _raced
from opswap.rules.conv.algorithm import NO_TIMER, TORCH, TORCH_CL
from opswap.targets import get_target
from opswap.targets.base import Target

from .._shapes import assert_same_at_other_shapes

RULES = ["conv.*"]


class Net(nn.Module):
    """A 3x3 conv with an in-place ReLU and an eval BatchNorm (a stateful module) after it,
    a grouped 7x7 without bias, a stride-2 3x3 (no FFT there) and a long 1-D conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6).eval()
        self.big = nn.Conv2d(6, 6, 7, padding=3, groups=2, bias=False)
        self.down = nn.Conv2d(6, 4, 3, stride=2)
        self.long = nn.Conv1d(6, 4, 15, padding=7)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.bn(F.relu_(self.a(x)))
        y = self.big(y) + y
        return self.down(y), self.long(y.flatten(2))


def _model() -> Net:
    torch.manual_seed(0)
    m = Net()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    return m


def scripted(winner: str, seen: list[set[str]]) -> Callable[[dict], dict[str, float]]:
    """A timer that runs each candidate once (they must work) and says `winner` took half
    the time of every other."""

    def timer(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
        for fn in fns.values():
            fn()
        seen.append(set(fns))
        return {n: (0.5e-3 if n == winner else 1e-3) for n in fns}

    return timer


def _target(timer: Callable[[dict], dict[str, float]] | None) -> Target:
    return dataclasses.replace(get_target("cpu"), timer=timer)


def _plan(method: str, winner: str, shape: Sequence[int] = (3, 3, 10, 9)):
    model = _model()
    x = torch.randn(*shape)
    captured = capture(model, (x,), method=method)
    seen: list[set[str]] = []
    plan = make_plan(
        captured, rules=RULES, exactness="approx", target=_target(scripted(winner, seen))
    )
    return model, captured, plan, seen


def _chosen(plan: Plan) -> dict[str, str]:
    return {d.site.data["conv"]: d.site.data["algorithm"] for d in plan.decisions}


@pytest.mark.parametrize("method", ["fx", "export"])
def test_the_scripted_winner_is_chosen_and_the_model_still_matches(method: str) -> None:
    model, captured, plan, seen = _plan(method, "fft")
    chosen = _chosen(plan)
    # the stride-2 conv cannot run as an FFT: there im2col ties PyTorch's conv and loses
    assert sorted(chosen.values()) == ["fft", "fft", "fft"], chosen
    assert len(seen) == 4  # one race per conv site, cached across its candidates
    assert any(TORCH_CL in s for s in seen) and all(TORCH in s for s in seen)
    skipped = " | ".join(s.reason for s in plan.skipped)
    assert "PyTorch's conv was fastest" in skipped and "stride [2, 2]" in skipped
    for d in plan.decisions:
        e = d.estimate
        assert e.measured_s["fft"] == 0.5e-3 and e.measured_s[TORCH] == 1e-3
        assert set(e.predicted_s) == set(e.measured_s) and all(
            v > 0 for v in e.predicted_s.values()
        )
        assert e.time_saved_s == pytest.approx(0.5e-3)
        assert "fft was fastest: fft 0.5 ms" in e.note and "im2col 1 ms" in e.note
    applied = apply_plan(captured, plan)
    assert not applied.failed
    targets = [str(n.target) for n in applied.gm.graph.nodes if n.op == "call_function"]
    assert sum("conv_fft" in t for t in targets) == 3
    x = torch.randn(3, 3, 10, 9)
    with torch.no_grad():
        for want, got in zip(model(x), applied.gm(x), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert assert_same_at_other_shapes(model, captured, applied.gm) >= 2


def test_im2col_wins_everywhere_and_the_plan_round_trips_through_json() -> None:
    model, captured, plan, _ = _plan("fx", "im2col", shape=(2, 3, 8, 11))
    assert sorted(_chosen(plan)) == ["a", "big", "down", "long"]
    assert set(_chosen(plan).values()) == {"im2col"}
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert [d.site.key for d in again.decisions] == [d.site.key for d in plan.decisions]
    assert again.decisions[0].estimate.measured_s == plan.decisions[0].estimate.measured_s
    # the chosen algorithm is in the site key: replayed without timing again
    applied = apply_plan(capture(model, (torch.randn(2, 3, 8, 11),), method="fx"), again)
    assert not applied.failed and len(applied.applied) == 4
    assert_same_at_other_shapes(model, captured, applied.gm)
    # the report lists every candidate of every raced site, roofline next to measured
    text = to_markdown(_raced(SimpleNamespace(plan=again)))[0]
    assert "roofline against measured" in text
    assert text.count("| im2col |") == 4 and text.count("| pytorch |") == 4


@pytest.mark.parametrize("winner", [TORCH, TORCH_CL])
def test_pytorch_winning_leaves_every_site_alone_with_the_times(winner: str) -> None:
    _, _, plan, _ = _plan("fx", winner)
    assert not plan.decisions
    reasons = [s.reason for s in plan.skipped]
    assert reasons and all("PyTorch's conv was fastest" in r for r in reasons)
    assert any("0.5 ms" in r and "im2col 1 ms" in r for r in reasons), reasons
    assert any("(the race's times: big@fft)" in r for r in reasons), reasons


def test_without_a_timer_no_site_is_chosen() -> None:
    captured = capture(_model(), (torch.randn(1, 3, 9, 9),), method="fx")
    plan = make_plan(captured, rules=RULES, exactness="approx", target=_target(None))
    assert not plan.decisions
    assert plan.skipped and all(NO_TIMER in s.reason for s in plan.skipped)


def test_at_exact_the_rule_is_not_planned_and_says_so() -> None:
    captured = capture(_model(), (torch.randn(1, 3, 9, 9),), method="fx")
    with pytest.raises(RuleError, match="add --exactness approx"):
        make_plan(captured, rules=RULES, exactness="exact", target=_target(scripted(TORCH, [])))


@torch.library.custom_op("opswaptest::noisy_conv", mutates_args=())
def _noisy_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    y = F.conv2d(x, weight, bias, 1, list(padding), 1, groups)
    return y * (1 + 1e-3 * torch.randn_like(y))


@pytest.fixture
def noisy() -> object:
    algorithm = ca.register(
        ca.ConvAlgorithm(
            name="noisy",
            op=torch.ops.opswaptest.noisy_conv.default,
            exactness="approx",
            refuses=lambda site: None if site.dims == 2 and site.stride == (1, 1) else "no",
            extra=lambda site: (list(site.padding), site.groups),
            multiplications=lambda site: site.direct_multiplications(),
        )
    )
    yield algorithm
    ca._REGISTRY.pop("noisy")


def test_an_algorithm_too_inexact_is_refused_with_both_errors(noisy: object) -> None:
    _, _, plan, seen = _plan("fx", "noisy")
    assert all("noisy" not in s for s in seen)  # never raced
    misses = [m.reason for m in plan.misses if "noisy" in m.reason]
    assert misses and all("x PyTorch's conv's (" in m and "noisy at " in m for m in misses)
    assert "noisy" not in _chosen(plan).values()


def test_a_bad_site_is_refused_in_words() -> None:
    class T(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.ConvTranspose2d(3, 4, 3)
            self.r = nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.t(self.r(x))

    captured = capture(T(), (torch.randn(1, 3, 6, 6),), method="fx")
    plan = make_plan(captured, rules=RULES, exactness="approx", target=_target(scripted(TORCH, [])))
    assert not plan.decisions
    assert any("padding_mode='reflect'" in m.reason for m in plan.misses)


def test_a_user_module_is_left_untouched() -> None:
    model = _model()
    before = copy.deepcopy(model.state_dict())
    _plan_model = capture(model, (torch.randn(2, 3, 8, 8),), method="fx")
    plan = make_plan(
        _plan_model, rules=RULES, exactness="approx", target=_target(scripted("fft", []))
    )
    apply_plan(_plan_model, plan)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _ranked(times: dict[str, float]) -> Callable[[dict], dict[str, float]]:
    """A timer that runs each candidate once and gives it `times`' figure (1 ms if unnamed)."""

    def timer(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
        for fn in fns.values():
            fn()
        return {n: times.get(n, 1e-3) for n in fns}

    return timer


@pytest.mark.parametrize(
    ("name", "sites"), [("onednn_prepacked", ["a", "big", "down"]), ("nnpack", ["down"])]
)
def test_a_cpu_library_conv_is_picked_only_where_it_is_measured_faster(
    name: str, sites: list[str]
) -> None:
    if ca.get(name).refuses(
        ca.ConvSite((1, 3, 9, 9), (3, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.float32, "cpu")
    ):
        pytest.skip(f"{name} cannot run in this build")
    model = _model()
    x = torch.randn(1, 3, 13, 9)
    captured = capture(model, (x,), method="fx")
    # slower than PyTorch's channels-last conv by a little: every site stays PyTorch's
    slower = _target(_ranked({TORCH_CL: 0.8e-3, name: 0.85e-3}))
    plan = make_plan(captured, rules=RULES, exactness="approx", target=slower)
    assert name not in _chosen(plan).values()
    assert any(f"{name} 0.85 ms" in s.reason for s in plan.skipped)
    # faster than both PyTorch layouts: chosen at every site it can run, and nowhere else
    faster = _target(_ranked({TORCH_CL: 0.8e-3, name: 0.7e-3}))
    plan = make_plan(captured, rules=RULES, exactness="approx", target=faster)
    chosen = _chosen(plan)
    assert sorted(c for c, a in chosen.items() if a == name) == sites, chosen
    if name == "nnpack":  # its Winograd/FFT tiles err 10-20x PyTorch's conv on 3 channels
        assert any(m.reason.startswith("nnpack at a: error ") for m in plan.misses)
    applied = apply_plan(captured, plan)
    assert not applied.failed
    with torch.no_grad():
        for want, got in zip(model(x), applied.gm(x), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert_same_at_other_shapes(model, captured, applied.gm)


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_the_race_times_candidates_on_the_layout_the_model_feeds(layout: str) -> None:
    seen: list[bool] = []

    def recorder(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        seen.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return F.conv2d(x, w, b, 1, 1)

    ca.register(
        ca.ConvAlgorithm(
            name="recorder",
            op=recorder,
            exactness="exact",
            refuses=lambda site: None if site.dims == 2 and site.stride == (1, 1) else "no",
            extra=lambda site: (),
            multiplications=lambda site: site.direct_multiplications(),
        )
    )
    try:
        x = torch.randn(1, 4, 9, 7)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        captured = capture(nn.Conv2d(4, 6, 3, padding=1), (x,), method="fx")
        plan = make_plan(
            captured, rules=RULES, exactness="approx", target=_target(scripted("recorder", []))
        )
        assert set(_chosen(plan).values()) == {"recorder"}
        # every call the race (and the plan's checks) made saw the model's layout
        assert seen and all(v == (layout == "channels_last") for v in seen)
    finally:
        ca._REGISTRY.pop("recorder")
