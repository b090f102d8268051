"""Regression tests of the core guarantees: verified against the user's module, right at
every shape the capture claims, in-place ops kept, the user's module left alone.
Each case was a wrong result or a mutation that an earlier version let through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap import artifact
from opswap.api import capture
from opswap.api import verify as api_verify
from opswap.config import OptimizeConfig
from opswap.errors import CaptureError, VerificationError
from opswap.pipeline import optimize
from opswap.planner import apply_plan, make_plan

QUICK = dict(bench=False, layers=False, measure_rules=False)


def _close(a, b, rel=1e-5):
    a, b = a.double(), b.double()
    assert a.shape == b.shape
    assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() <= rel


def _matches(module, candidate, *inputs_list, rel=1e-5):
    from torch.utils import _pytree as pytree

    with torch.no_grad():
        for xs in inputs_list:
            got, want = pytree.tree_leaves(candidate(*xs)), pytree.tree_leaves(module(*xs))
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                _close(g, w, rel)


# --------------------------------------------------------------------------- 1. the capture


class AliasThenInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        z = y.view(-1)
        y += 1  # FX traces this out of place, so z would miss the +1
        return z


def test_capture_that_differs_from_the_module_is_not_used():
    m = AliasThenInPlace().eval()
    x = torch.randn(2, 8)
    c = capture(m, (x,))
    assert c.method == "export"
    assert any("does not reproduce the model" in n for n in c.notes)
    r = optimize(m, (x,), OptimizeConfig(**QUICK))
    assert r.verification.passed
    _matches(m, r.candidate, (x,), (torch.randn(5, 8),))


def test_capture_no_method_reproduces_is_refused_with_the_cause():
    class PythonState(nn.Module):  # a counter outside buffers: every capture bakes it
        def __init__(self):
            super().__init__()
            self.k = 0

        def forward(self, x):
            self.k += 1
            return x * self.k

    with pytest.raises(CaptureError, match="faithfully.*in-place op.*state kept outside"):
        capture(PythonState(), (torch.randn(2, 3),))


def test_example_that_does_not_fit_the_model_says_so():
    with pytest.raises(CaptureError) as e:
        capture(nn.Linear(8, 4), (torch.randn(2, 5),))
    msg = str(e.value)
    assert "failed on the example inputs (float32[2,5])" in msg
    assert "traceable" not in msg and "\n" not in msg


# --------------------------------------------------------------------------- 3-4. verification


def test_zero_or_negative_samples_are_refused():
    m = nn.Linear(4, 4)
    for n in (0, -1):
        with pytest.raises(VerificationError, match="at least"):
            optimize(m, (torch.randn(2, 4),), OptimizeConfig(samples=n, **QUICK))
        with pytest.raises(VerificationError, match="at least one sample"):
            api_verify(m, nn.Linear(4, 4), (torch.randn(2, 4),), samples=n)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )

    def forward(self, x):
        return self.body(x)


def _trained_bn(m):
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2)
    return m.eval()


def test_exact_folds_of_a_bfloat16_model_are_kept():
    m = _trained_bn(ConvBN()).to(torch.bfloat16)
    x = torch.randn(2, 3, 12, 12, dtype=torch.bfloat16)
    r = optimize(m, (x,), OptimizeConfig(rules=["fusion.conv_bn"], **QUICK))
    assert len(r.applied) == 2 and not r.rolled_back
    assert r.verification.passed
    # judged against the model's own bf16 rounding, not float32's 1e-5
    assert r.verification.tolerance.rel_l2_max > 1e-4
    # a budget the user gives is kept as written
    strict = optimize(
        m, (x,), OptimizeConfig(rules=["fusion.conv_bn"], budget="rel_l2<=1e-6", **QUICK)
    )
    assert strict.verification.tolerance.rel_l2_max == 1e-6


# --------------------------------------------------------------------------- 5-8. shapes


def _optimized(model, inputs, rules, **config):
    r = optimize(model, inputs, OptimizeConfig(rules=rules, **QUICK, **config))
    assert r.verification.passed, r.verification.reasons
    return r


def test_collapse_view_keeps_sizes_symbolic():
    class Views(nn.Module):
        def forward(self, x):
            a = x.flatten(1).unsqueeze(1).squeeze(1)
            b = x.flatten(1).unsqueeze(1).flatten(2)
            return a * 2, b + 1

    m = Views()
    x = torch.randn(2, 2, 4)
    r = _optimized(m, (x,), ["layout.collapse_view"])
    assert len(r.applied) == 2
    _matches(m, r.candidate, (torch.randn(5, 2, 4),), (torch.randn(1, 2, 4),))
    # another split of the same element count: sizes follow the input, not the example
    _matches(m, r.candidate, (torch.randn(4, 4, 1),))


def test_squeeze_that_is_a_no_op_only_at_batch_one_stays():
    class Squeeze(nn.Module):
        def forward(self, x):
            return x.squeeze(0) * 2

    m = Squeeze()
    r = _optimized(m, (torch.randn(1, 3, 8),), ["layout.collapse_view"])
    assert not r.applied
    _matches(m, r.candidate, (torch.randn(3, 3, 8),))


def test_layer_norm_over_a_dynamic_dim_is_refused():
    class OverTime(nn.Module):
        def forward(self, x):  # x: [B, T], normalised over T
            m = x.mean(-1, keepdim=True)
            v = ((x - m) ** 2).mean(-1, keepdim=True)
            return (x - m) / torch.sqrt(v + 1e-5)

    m = OverTime()
    x = torch.randn(2, 10)
    r = _optimized(m, (x,), ["fusion.layer_norm"], dynamic="batch,0:1=time")
    assert not r.applied
    assert any("whose size follows the input" in miss.reason for miss in r.plan.misses)
    _matches(m, r.candidate, (torch.randn(3, 7),))
    # auto probes the time dim too (the model takes any length), so keep it static by hand
    assert "dim0_1" in [a.name for a in _optimized(m, (x,), []).dynamic.axes]
    fixed = _optimized(m, (x,), ["fusion.layer_norm"], dynamic="batch")  # the fusion applies
    assert len(fixed.applied) == 1


def test_contiguous_needed_at_other_batches_is_kept():
    class T(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1).contiguous().view(-1) * 2

    m = T()
    r = _optimized(m, (torch.randn(1, 8),), ["layout.drop_identity"])
    assert not r.applied
    _matches(m, r.candidate, (torch.randn(2, 8),))


def test_parallel_linear_views_at_other_lengths():
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            b, s = x.size(0), x.size(1)
            return self.q(x).view(b, s * 8) + self.k(x).view(b, s * 8) + self.v(x).view(b, s * 8)

    m = QKV().eval()
    r = _optimized(m, (torch.randn(2, 1, 8),), ["fusion.parallel_linear"], dynamic="batch,0:1=seq")
    assert len(r.applied) == 1
    _matches(m, r.candidate, (torch.randn(3, 4, 8),))


def test_channels_last_returns_contiguous_outputs_of_any_rank():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)

        def forward(self, x):
            return self.conv(x).flatten(2)

    m = Head().eval()
    x = torch.randn(2, 3, 10, 10)
    captured = capture(m, (x,))
    plan = make_plan(captured, rules=["layout.channels_last"], target=_nhwc_target())
    assert len(plan.decisions) == 1
    out = apply_plan(captured, plan).gm(x)
    assert out.is_contiguous()
    out.view(-1)


def _nhwc_target():
    from opswap.targets import Target

    return Target(
        name="cpu",
        description="test CPU",
        kind="cpu",
        peak_flops={"float32": 1e12},
        mem_bandwidth=50e9,
        memory_bytes=0,
        dtypes=("float32",),
        layout="channels_last",
    )


def test_saved_model_runs_at_other_shapes(tmp_path):
    m = _trained_bn(ConvBN())
    x = torch.randn(2, 3, 12, 12)
    r = _optimized(m, (x,), [])
    r.save(tmp_path)
    loaded = artifact.load(tmp_path)
    assert not (tmp_path / "model_shapes.txt").exists()
    _matches(m, loaded, (x,), (torch.randn(1, 3, 12, 12),), (torch.randn(5, 3, 12, 12),), rel=1e-4)


def test_verification_catches_a_candidate_wrong_only_at_other_batches():
    m = nn.Linear(4, 4)

    def batch_two_only(x):
        return m(x).view(2, 4)

    v = api_verify(m, batch_two_only, (torch.randn(2, 4),))
    assert not v.passed and "batch 1" in " ".join(v.reasons)
    assert v.shapes[1:] == ["batch 1", "batch 3"]


def test_strides_of_outputs_are_compared():
    m = nn.Linear(4, 6)
    v = api_verify(m, lambda x: m(x).t().contiguous().t(), (torch.randn(3, 4),))
    assert not v.passed and ".view() of it would raise" in v.reasons[0]


# --------------------------------------------------------------------------- 9. the module


class Watched(nn.Module):
    """Counts its calls in a buffer and records every train()/eval() call on it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("calls", torch.zeros(()))
        self.mode_calls = []

    def train(self, mode=True):
        self.mode_calls.append(mode)
        return super().train(mode)

    def forward(self, x):
        self.calls += 1
        return F.relu(self.bn(self.conv(x)))


def test_the_users_module_is_never_called_nor_changed():
    m = Watched()
    m.eval()
    m.mode_calls.clear()
    fired = []
    m.register_forward_hook(lambda *a: fired.append(1))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(2, 3, 9, 9)
    # bench, layers and the per-rule timing on; pruning off, so that which rules a busy
    # machine measures as slower on this tiny model cannot leave nothing applied
    r = optimize(m, (x,), OptimizeConfig(samples=2, compare="none", prune_slow=False))
    assert r.applied and r.benchmark is not None
    assert fired == [] and m.mode_calls == [] and m.calls.item() == 0
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert any("hook" in n for n in r.notes)


class CountsIntoOutput(nn.Module):
    """A call counter the output depends on: the capture must keep the state, and
    opswap's own runs (checks, verification, timing) must leave it where it started."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * self.calls


def test_a_stateful_candidate_starts_where_the_model_was():
    m = CountsIntoOutput().eval()
    x = torch.randn(2, 4)
    r = optimize(m, (x,), OptimizeConfig(samples=2, compare="none", layers=False))
    assert r.verification.passed and r.benchmark is not None
    assert m.calls.item() == 0
    assert r.candidate.get_buffer("calls").item() == 0  # despite thousands of timed calls
    with torch.no_grad():
        torch.testing.assert_close(r.candidate(x), m(x))  # first call of each: x * 1
