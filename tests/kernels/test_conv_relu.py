"""opswap::conv_relu: the registered op against its reference, on odd shapes, through
autograd, torch.export (save and load) and torch.compile."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from opswap.kernels.conv_relu import _PACKED, conv_relu, direct, reference
from opswap.rules.fusion._fused_conv_relu import FusedConvReLU


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3),
    cin=st.integers(1, 9),
    cout=st.integers(1, 9),
    hw=st.tuples(st.integers(3, 11), st.integers(3, 11)),
    k=st.sampled_from([1, 2, 3]),
    stride=st.integers(1, 2),
    pad=st.integers(0, 1),
    dil=st.integers(1, 2),
    bias=st.booleans(),
    nhwc=st.booleans(),
)
def test_op_matches_reference_on_odd_shapes(n, cin, cout, hw, k, stride, pad, dil, bias, nhwc):
    torch.manual_seed(n * 100 + cin * 10 + cout)
    if (k - 1) * dil + 1 > min(hw) + 2 * pad:
        return
    x = torch.randn(n, cin, *hw)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(cout, cin, k, k), torch.randn(cout) if bias else None
    args = (x, w, b, [stride] * 2, [pad] * 2, [dil] * 2, 1)
    ref = F.relu(F.conv2d(x, w, b, stride, pad, dil))
    for fn in (conv_relu, direct):
        with torch.inference_mode():
            y = fn(*args)
        assert y.shape == ref.shape and y.stride() == reference(*args).stride()
        assert _rel(y, ref) <= 1e-5
        assert (y >= 0).all()


def test_opcheck_and_gradients():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 6, 7, 5), torch.randn(4, 3, 3, 3), torch.randn(4)
    args = (x, w, b, [1, 2], [1, 0], [1, 1], 2)  # groups=2
    torch.library.opcheck(conv_relu, args)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    conv_relu(leaves[0], leaves[1], leaves[2], *args[3:]).pow(2).sum().backward()
    plain = [t.clone().requires_grad_() for t in (x, w, b)]
    F.relu(F.conv2d(plain[0], plain[1], plain[2], (1, 2), (1, 0), 1, 2)).pow(2).sum().backward()
    for a, r in zip(leaves, plain, strict=True):
        assert _rel(a.grad, r.grad) <= 1e-5


def test_new_weights_are_seen_by_the_cached_kernel():
    w = torch.randn(4, 3, 3, 3)
    x = torch.randn(2, 3, 6, 6)
    with torch.inference_mode():
        direct(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    with torch.no_grad():
        w.mul_(-1)  # in place: same tensor, new version
    with torch.inference_mode():
        assert (
            _rel(direct(x, w, None, [1, 1], [1, 1], [1, 1], 1), F.relu(F.conv2d(x, w, None, 1, 1)))
            <= 1e-5
        )
    # the cache keeps no weight alive: once the caller drops it, its entry goes (other
    # tests in this process may hold weights of the same shape, so the check is by identity)
    assert w in _PACKED
    gc.collect()  # earlier tests' dropped weights leave now, not inside the count below
    before = len(_PACKED)
    gone = weakref.ref(w)
    del w
    gc.collect()
    assert gone() is None and len(_PACKED) == before - 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_export_keeps_the_op_and_the_saved_program_runs_it(tmp_path, dynamic):
    torch.manual_seed(1)
    m = FusedConvReLU(
        torch.randn(8, 3, 3, 3), torch.randn(8), (1, 1), (1, 1), (1, 1), 1, requires_grad=False
    )
    x = torch.randn(2, 3, 9, 9)
    shapes = ({0: torch.export.Dim.AUTO},) if dynamic else None
    ep = torch.export.export(m, (x,), dynamic_shapes=shapes, strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.opswap.conv_relu.default]
    path = tmp_path / "m.pt2"
    torch.export.save(ep, str(path))
    loaded = torch.export.load(str(path)).module()
    assert any(n.target == torch.ops.opswap.conv_relu.default for n in loaded.graph.nodes)
    other = torch.randn(3 if dynamic else 2, 3, 9, 9)
    with torch.inference_mode():
        assert _rel(loaded(other), F.relu(F.conv2d(other, m.weight, m.bias, 1, 1))) <= 1e-5


def test_compile_keeps_the_op():
    m = FusedConvReLU(torch.randn(4, 3, 3, 3), None, (1, 1), (1, 1), (1, 1), 1, requires_grad=False)
    x = torch.randn(2, 3, 6, 6)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        assert _rel(compiled(x), F.relu(F.conv2d(x, m.weight, None, 1, 1))) <= 1e-5


def _one_channel_cnn(batch: int, channels_last: bool) -> tuple[nn.Module, torch.Tensor]:
    """Conv2d(1, 32)-BN-ReLU-Conv2d(32, 8)-BN-ReLU in eval mode: with one input channel,
    NCHW and channels-last strides of the input (and of the first weight) are the same
    memory, which the first conv_relu's layout must not depend on."""
    torch.manual_seed(batch)
    m = nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
    ).eval()  # fmt: skip
    for bn in (m[1], m[4]):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(batch, 1, 9, 7)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return m, x


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_opswap_backend_runs_a_one_channel_cnn_as_eager(channels_last):
    """The issue's crash: Inductor asserted the fake kernel's channels-last strides for the
    first conv_relu, whose oneDNN kernel wrote NCHW (torch 2.13, batch 4)."""
    from opswap.backends.dynamo import backend

    torch._dynamo.reset()
    m, x = _one_channel_cnn(4, channels_last)
    be = backend()
    compiled = torch.compile(m, backend=be)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)
        if not channels_last:  # another batch: Dynamo recompiles with the batch symbolic
            other = torch.randn(2, 1, 9, 7)
            torch.testing.assert_close(compiled(other), m(other), rtol=1e-5, atol=1e-5)
    assert all(r.applied.get("fusion.conv_relu") == 2 for r in be.reports), be.summary()
    assert len(be.reports) == (1 if channels_last else 2)
    torch._dynamo.reset()
