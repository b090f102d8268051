"""A model that writes into its inputs: the caller's tensors stay as they were through every
stage, and every run opswap makes (capture, probes, verification, race, attribution, the
benchmark) sees the inputs as the caller gave them."""

from __future__ import annotations

import torch
from torch import nn

import opswap
from opswap.graph.capture import capture
from opswap.graph.inputs import fresh, writes


class ScalesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        x.mul_(2)  # in place, on the caller's tensor
        return torch.relu(self.bn(self.fc(x)))


def _model():
    m = ScalesItsInput().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def test_fresh_copies_keep_strides_and_values():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    (y, n) = fresh((x, 3))
    assert y is not x and y.data_ptr() != x.data_ptr()
    assert y.stride() == x.stride() and torch.equal(y, x) and n == 3


def test_writes_names_the_inputs_forward_writes_into():
    m = _model()
    x, keep = torch.randn(4, 8), torch.randn(4, 8)
    before = x.clone()
    with torch.no_grad():
        assert writes(lambda xs: m(xs[0]), (x,)) == [0]
        assert writes(lambda xs: m.fc(xs[0]), (keep,)) == []
    assert torch.equal(x, before)  # it ran on a copy


def test_capture_leaves_the_callers_tensor_alone_and_says_so():
    x = torch.randn(4, 8)
    before = x.clone()
    c = capture(_model(), (x,))
    assert torch.equal(x, before)
    assert c.writes_inputs == [0]
    assert any("writes into its input" in n for n in c.notes)
    assert torch.equal(c.example_inputs[0], before)  # the private copy is as given, too


def test_optimize_with_the_race_never_changes_the_inputs_nor_times_on_changed_ones(tmp_path):
    m = _model()
    x = torch.randn(4, 8)
    before = x.clone()
    r = opswap.optimize(m, (x,), compare="none")
    assert torch.equal(x, before), "the caller's example tensor was written"
    assert torch.equal(r.example_inputs[0], before), "the race ran on inputs it had changed"
    assert r.verification.passed and any(s.rule == "fusion.linear_bn" for s in r.applied)
    timed = [v for v in r.variants if v.ms is not None]
    assert timed and all(v.verified for v in timed)
    # the result computes what the module does, at the example and at another batch
    r.save(tmp_path)
    loaded = opswap.load_optimized(tmp_path)
    for xs in (before, torch.randn(7, 8)):
        with torch.no_grad():
            want = m(xs.clone())
            for got in (r.candidate(xs.clone()), loaded(xs.clone())):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_api_bench_and_verify_leave_the_inputs_alone():
    m = _model()
    x = torch.randn(4, 8)
    before = x.clone()
    b = opswap.api.bench(m, _model(), (x,))
    assert torch.equal(x, before)
    assert any("writes into its inputs" in n for n in b.notes)
    v = opswap.api.verify(m, m, (x,))
    assert v.passed and torch.equal(x, before)
