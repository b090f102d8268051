"""backends.eager: a loaded model.pt2 calls opswap's Triton ops without the dispatcher
only where that changes nothing: plain eager calls with no gradient to record. Traced,
compiled, fake-tensor and gradient-recording calls still reach the op, and every call
gives the op's numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opswap.kernels.rms_norm  # noqa: F401  (registers opswap::rms_norm)
from opswap.backends.pt2 import load
from opswap.kernels._triton_op import PYTHON


class Norms(nn.Module):
    def __init__(self, n: int = 24):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        h = torch.ops.opswap.rms_norm(x, self.w, 1e-6, 0.0, False)
        h = self.lin(h).relu()  # an in-place-free op between two opswap calls
        return torch.ops.opswap.rms_norm(h + x, self.w, 1e-6, 0.0, False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    m = Norms().eval()
    x = torch.randn(3, 5, 24)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: batch},))
    path = tmp_path_factory.mktemp("eager") / "model.pt2"
    torch.export.save(ep, str(path))
    return m, path


def _spy(monkeypatch):
    calls = []
    fn = PYTHON["opswap::rms_norm"]

    def counted(*a, **k):
        calls.append(1)
        return fn(*a, **k)

    # the graph's direct function holds the implementation it was made with: rebuild it
    monkeypatch.setitem(PYTHON, "opswap::rms_norm", counted)
    return calls


def test_loaded_program_calls_the_implementation_directly_with_the_ops_numbers(saved, monkeypatch):
    m, path = saved
    calls = _spy(monkeypatch)
    loaded = load(path)
    targets = [n.target for n in loaded.graph.nodes if n.op == "call_function"]
    direct = [t for t in targets if getattr(t, "opswap_op", None) is not None]
    assert len(direct) == 2 and all(
        t.opswap_op is torch.ops.opswap.rms_norm.default for t in direct
    )
    for b in (1, 7):  # other batch sizes than the export's
        x = torch.randn(b, 5, 24)
        with torch.inference_mode():
            got = loaded(x)
        with torch.no_grad():
            want = m(x)
        torch.testing.assert_close(got, want)
    assert len(calls) == 4  # two sites, two calls: each went straight to the Python


def test_calls_that_record_gradients_or_are_traced_reach_the_op(saved, monkeypatch):
    m, path = saved
    calls = _spy(monkeypatch)
    loaded = load(path)
    x = torch.randn(2, 5, 24, requires_grad=True)
    out = loaded(x)  # grad mode on, a leaf that wants a gradient: the op and its autograd
    assert not calls
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    x2 = x.detach().clone().requires_grad_()
    m(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)

    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
        torch.no_grad(),
    ):  # a dispatch mode: the op's fake kernel
        fake = mode.from_tensor(torch.randn(4, 5, 24))
        assert loaded(fake).shape == (4, 5, 24)
    assert not calls

    compiled = torch.compile(loaded, backend="aot_eager", dynamic=False)
    y = torch.randn(2, 5, 24)
    with torch.no_grad():
        torch.testing.assert_close(compiled(y), m(y))
    assert not calls  # torch.compile traced the op, not the direct call


def test_an_exported_loaded_module_keeps_the_op(saved):
    _, path = saved
    loaded = load(path)
    x = torch.randn(2, 5, 24)
    again = torch.export.export(loaded, (x,))
    ops = {str(n.target) for n in again.graph.nodes if n.op == "call_function"}
    assert "opswap.rms_norm.default" in ops
    assert not any("direct_" in o for o in ops)
