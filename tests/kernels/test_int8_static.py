"""opswap.kernels.int8_static: the int8 kernels against the integer math they claim
(exactly), on odd shapes, and the guard that keeps a CPU without VNNI from saturating."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opswap.graph.observers import qparams
from opswap.kernels import int8_static as k

needs_onednn = pytest.mark.skipif(
    not k.onednn_available(), reason="onednn's int8 kernels need an x86 CPU build of torch"
)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("m,kk,n", [(1, 123, 17), (5, 7, 3), (33, 64, 96), (2 * 9, 768, 80)])
@pytest.mark.parametrize("symmetric", [False, True])
@needs_onednn
def test_linear_kernel_is_the_integer_math(m, kk, n, symmetric):
    g = torch.Generator().manual_seed(m + kk + n)
    x = torch.randn(3, m, kk, generator=g) * 2 + 0.5
    w = torch.randn(n, kk, generator=g)
    b = torch.randn(n, generator=g)
    wq, ws = k.quantize_weight(w)
    p = qparams(float(x.min()), float(x.max()), symmetric)
    y = torch.ops.opswap.int8_static_linear(x, wq, ws, p.scale, p.zero_point, b)
    ref = k.reference_linear(x, wq, ws, p.scale, p.zero_point, b)
    assert y.shape == (3, m, n)
    # the sums are exact integers in both; only the float rescale may round differently
    assert _rel(y, ref) < 1e-6
    # and the quantisation itself stays close to float32 (7-bit weights on an AVX2 CPU)
    assert _rel(y, F.linear(x, w, b)) < 0.05


@pytest.mark.parametrize(
    "shape,out,ksize,stride,pad,groups",
    [
        ((2, 3, 17, 13), 8, 3, 1, 1, 1),
        ((1, 16, 9, 9), 16, 3, 2, 1, 16),  # depthwise, strided
        ((3, 5, 7, 7), 6, 1, 1, 0, 1),  # pointwise, odd channels
        ((1, 8, 11, 6), 12, 5, 1, 2, 4),  # grouped 5x5
    ],
)
@pytest.mark.parametrize("post", ["none", "relu"])
@needs_onednn
def test_conv_kernel_is_the_integer_math(shape, out, ksize, stride, pad, groups, post):
    g = torch.Generator().manual_seed(sum(shape) + out)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out, shape[1] // groups, ksize, ksize, generator=g) * 0.2
    b = torch.randn(out, generator=g)
    wq, ws = k.quantize_weight(w)
    p = qparams(float(x.min()), float(x.max()), False)
    args = ([stride] * 2, [pad] * 2, [1, 1], groups)
    y = torch.ops.opswap.int8_static_conv2d(x, wq, ws, p.scale, p.zero_point, b, *args, post)
    ref = k.reference_conv2d(x, wq, ws, p.scale, p.zero_point, b, *args)
    ref = torch.relu(ref) if post == "relu" else ref
    assert y.shape == ref.shape
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert _rel(y, ref) < 1e-6
    exact = F.conv2d(x, w, b, stride, pad, 1, groups)
    exact = torch.relu(exact) if post == "relu" else exact
    assert _rel(y, exact) < 0.05


@needs_onednn
def test_wide_weights_never_saturate(monkeypatch):
    """A u8 x s8 product pair overflows int16 on CPUs without VNNI: weights quantised to
    the full int8 range (as on a VNNI machine) must then run the reference, not the kernel."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(64, 768, generator=g) * 4  # uint8 values up to 255
    w = torch.randn(96, 768, generator=g)
    wq, ws = k.quantize_weight(w, qmax=127)
    p = qparams(0.0, float(x.max()), False)
    ref = k.reference_linear(x, wq, ws, p.scale, p.zero_point, None)
    y = torch.ops.opswap.int8_static_linear(x, wq, ws, p.scale, p.zero_point, None)
    assert _rel(y, ref) < 1e-6
    if not k.has_vnni():
        # the hazard is real here: the raw kernel on these weights is wrong
        packed = torch.ops.onednn.qlinear_prepack(wq, None)
        xq = k.quantize_activation(x, p.scale, p.zero_point)
        raw = torch.ops.onednn.qlinear_pointwise(
            xq, p.scale, p.zero_point, packed, ws, torch.zeros(96, dtype=torch.int64), None,
            1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        assert _rel(raw, ref) > 1e-3
        assert k.weight_qmax() == 63


def test_reference_runs_where_onednn_does_not(monkeypatch):
    monkeypatch.setattr(k, "onednn_available", lambda: False)
    x = torch.randn(4, 32)
    w = torch.randn(8, 32)
    wq, ws = k.quantize_weight(w)
    p = qparams(float(x.min()), float(x.max()), False)
    y = torch.ops.opswap.int8_static_linear(x, wq, ws, p.scale, p.zero_point, None)
    assert torch.equal(y, k.reference_linear(x, wq, ws, p.scale, p.zero_point, None))


def test_prepacked_weights_follow_writes():
    """The cache of prepacked weights notices a weight written in place."""
    if not k.onednn_available():
        pytest.skip("onednn's int8 kernels need an x86 CPU build of torch")
    x = torch.randn(4, 32)
    w = torch.randn(16, 32)
    wq, ws = k.quantize_weight(w)
    p = qparams(float(x.min()), float(x.max()), False)
    y1 = torch.ops.opswap.int8_static_linear(x, wq, ws, p.scale, p.zero_point, None)
    wq.neg_()
    y2 = torch.ops.opswap.int8_static_linear(x, wq, ws, p.scale, p.zero_point, None)
    assert _rel(y2, -y1) < 1e-6


def test_weight_quantisation_per_channel_and_per_tensor():
    w = torch.randn(6, 5) * torch.arange(1, 7).float()[:, None]
    q, s = k.quantize_weight(w, per_channel=True, qmax=127)
    assert q.dtype == torch.int8 and q.abs().amax(dim=1).eq(127).all()
    assert torch.allclose(q.float() * s[:, None], w, atol=float(s.max()) / 2 + 1e-6)
    qt, st = k.quantize_weight(w, per_channel=False, qmax=127)
    assert torch.all(st == st[0]) and int(qt.abs().max()) == 127
    # per-tensor loses the small channels' precision: per-channel errs less
    err_c = (q.float() * s[:, None] - w).abs().sum()
    err_t = (qt.float() * st[:, None] - w).abs().sum()
    assert err_c < err_t


@needs_onednn
def test_weights_made_under_inference_mode_run_every_cached_kernel():
    """A model loaded under torch.inference_mode has weights without a version counter:
    every kernel that caches work per weight (onednn's int8 linear and convolution, FBGEMM's
    int8 linear, the conv + ReLU op) must run them, not fail reading the counter (the int8
    ones did: "Inference tensors do not track version counter")."""
    from opswap.kernels import conv_relu, int8_fbgemm

    torch.manual_seed(3)
    with torch.inference_mode():
        x = torch.randn(5, 48)
        w = torch.randn(24, 48)
        b = torch.randn(24)
        wq, ws = k.quantize_weight(w)
        assert wq.is_inference()
        p = qparams(float(x.min()), float(x.max()), False)
        for _ in range(2):  # the second call takes the cached entry
            y = torch.ops.opswap.int8_static_linear(x, wq, ws, p.scale, p.zero_point, b)
            ref = k.reference_linear(x, wq, ws, p.scale, p.zero_point, b)
            assert _rel(y, ref) < 1e-6
        xc = torch.randn(2, 4, 9, 9)
        wc = torch.randn(6, 4, 3, 3) * 0.2
        wcq, wcs = k.quantize_weight(wc)
        pc = qparams(float(xc.min()), float(xc.max()), False)
        args = ([1, 1], [1, 1], [1, 1], 1, "relu")
        for _ in range(2):
            yc = torch.ops.opswap.int8_static_conv2d(
                xc, wcq, wcs, pc.scale, pc.zero_point, None, *args
            )
            refc = k.reference_conv2d(xc, wcq, wcs, pc.scale, pc.zero_point, None, *args[:4])
            assert _rel(yc, torch.relu(refc)) < 1e-5
        for _ in range(2):
            yr = conv_relu.direct(xc, wc, None, [1, 1], [1, 1], [1, 1], 1)
            assert _rel(yr, F.relu(F.conv2d(xc, wc, None, 1, 1))) <= 1e-5
        if int8_fbgemm.available():
            from opswap.kernels.int8_linear import quantize_weight

            fq, fs = quantize_weight(w)  # the dynamic scheme's weights
            for _ in range(2):
                yf = int8_fbgemm.direct(x, fq, fs, b)
                assert _rel(yf, int8_fbgemm.reference(x, fq, fs, b)) < 1e-3


@needs_onednn
def test_a_conv_weight_is_packed_for_each_input_shape_it_meets():
    """onednn picks a convolution's weight blocking from the whole problem: the weight is
    packed for the input shape it runs on (packed for a guessed shape, it was reordered
    again on every call), once per shape, and every shape gets the right answer."""
    torch.manual_seed(7)
    w = torch.randn(24, 16, 3, 3) * 0.2
    b = torch.randn(24)
    wq, ws = k.quantize_weight(w)
    args = ([1, 1], [1, 1], [1, 1], 1)
    shapes = [(1, 16, 14, 14), (3, 16, 9, 17), (1, 16, 14, 14)]
    for shape in shapes:
        x = torch.randn(*shape)
        p = qparams(float(x.min()), float(x.max()), False)
        y = torch.ops.opswap.int8_static_conv2d(x, wq, ws, p.scale, p.zero_point, b, *args, "none")
        ref = k.reference_conv2d(x, wq, ws, p.scale, p.zero_point, b, *args)
        assert _rel(y, ref) < 1e-5, shape
    packed = [key for key in k._PACKED if key[0] == id(wq) and key[1] == "conv2d"]
    assert {key[-1] for key in packed} >= {(1, 16, 14, 14), (3, 16, 9, 17)}


@pytest.mark.parametrize(
    "shape,mid,out,ksize,stride,pad,groups",
    [
        ((1, 16, 11, 7), 12, 20, 3, 1, 1, 1),
        ((2, 5, 9, 9), 8, 8, 1, 2, 0, 1),  # odd channels, strided pointwise
        ((1, 12, 13, 10), 12, 6, 3, 1, 1, 12),  # depthwise first
    ],
)
@pytest.mark.parametrize("post", ["none", "relu"])
@pytest.mark.parametrize("kernel", [True, False], ids=["onednn", "reference"])
def test_uint8_handoff_between_convolutions(
    monkeypatch, shape, mid, out, ksize, stride, pad, groups, post, kernel
):
    """A convolution that requantises its output to the next one's input scale (uint8 out)
    and the next one taking that uint8 map give what the two give through float32 (the
    next one quantising the float map itself): the same bytes, up to a rounding of a value
    that falls on a half step, at any shape, on the kernel and on the reference."""
    if kernel and not k.onednn_available():
        pytest.skip("onednn's int8 kernels need an x86 CPU build of torch")
    if not kernel:
        monkeypatch.setattr(k, "onednn_available", lambda: False)
    g = torch.Generator().manual_seed(sum(shape) + mid + out)
    x = torch.randn(*shape, generator=g)
    w1 = torch.randn(mid, shape[1] // groups, ksize, ksize, generator=g) * 0.3
    w2 = torch.randn(out, mid, 3, 3, generator=g) * 0.2
    b1, b2 = torch.randn(mid, generator=g), torch.randn(out, generator=g)
    q1, s1 = k.quantize_weight(w1)
    q2, s2 = k.quantize_weight(w2)
    p1 = qparams(float(x.min()), float(x.max()), False)
    a1 = ([stride] * 2, [pad] * 2, [1, 1], groups)
    a2 = ([1, 1], [1, 1], [1, 1], 1)
    op = torch.ops.opswap.int8_static_conv2d
    mid_f = op(x, q1, s1, p1.scale, p1.zero_point, b1, *a1, post)
    p2 = qparams(float(mid_f.min()), float(mid_f.max()), False)
    mid_q = op(x, q1, s1, p1.scale, p1.zero_point, b1, *a1, post, p2.scale, p2.zero_point)
    assert mid_q.dtype == torch.uint8 and mid_q.shape == mid_f.shape
    assert mid_q.is_contiguous(memory_format=torch.channels_last)
    # the epilogue's requantisation is the next layer's quantise pass on the float map
    expect = k.quantize_activation(mid_f, p2.scale, p2.zero_point)
    diff = (mid_q.int() - expect.int()).abs()
    assert int(diff.max()) <= 1 and float(diff.float().mean()) < 0.01
    y_handoff = op(mid_q, q2, s2, p2.scale, p2.zero_point, b2, *a2, "none")
    y_float = op(mid_f, q2, s2, p2.scale, p2.zero_point, b2, *a2, "none")
    assert y_handoff.dtype == torch.float32 and y_handoff.shape == y_float.shape
    assert _rel(y_handoff, y_float) < 2e-3
    # and against the exact float32 convolutions, as close as int8 is
    exact = F.conv2d(x, w1, b1, stride, pad, 1, groups)
    exact = F.conv2d(torch.relu(exact) if post == "relu" else exact, w2, b2, 1, 1)
    assert _rel(y_handoff, exact) < 0.06


@needs_onednn
def test_uint8_output_of_the_kernel_is_the_reference_bytes():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 7, 10, 9, generator=g)
    w = torch.randn(9, 7, 3, 3, generator=g) * 0.3
    wq, ws = k.quantize_weight(w)
    p = qparams(float(x.min()), float(x.max()), False)
    args = ([1, 1], [1, 1], [1, 1], 1, "relu", 0.05, 3)
    y = torch.ops.opswap.int8_static_conv2d(x, wq, ws, p.scale, p.zero_point, None, *args)
    ref = k.reference_conv2d(x, wq, ws, p.scale, p.zero_point, None, *args)
    assert y.dtype == ref.dtype == torch.uint8
    assert int((y.int() - ref.int()).abs().max()) <= 1
    assert int(y.min()) >= 3  # ReLU then the zero point: nothing below it


@pytest.mark.parametrize("post", ["none", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("kernel", [True, False], ids=["onednn", "reference"])
@pytest.mark.parametrize("lead,kin,mid,n", [((5,), 37, 19, 11), ((2, 7), 64, 96, 33)])
def test_linear_handoff_with_the_activation_in_the_epilogue(
    monkeypatch, post, kernel, lead, kin, mid, n
):
    """A Linear that applies its activation in the epilogue and requantises to the next
    Linear's input scale (uint8 out), the next taking that uint8, gives what the pair gives
    through float32 with the activation as its own op."""
    if kernel and not k.onednn_available():
        pytest.skip("onednn's int8 kernels need an x86 CPU build of torch")
    if not kernel:
        monkeypatch.setattr(k, "onednn_available", lambda: False)
    g = torch.Generator().manual_seed(kin + mid + n)
    x = torch.randn(*lead, kin, generator=g)
    w1, w2 = torch.randn(mid, kin, generator=g) * 0.2, torch.randn(n, mid, generator=g) * 0.2
    b1, b2 = torch.randn(mid, generator=g), torch.randn(n, generator=g)
    q1, s1 = k.quantize_weight(w1)
    q2, s2 = k.quantize_weight(w2)
    p1 = qparams(float(x.min()), float(x.max()), False)
    op = torch.ops.opswap.int8_static_linear
    h = op(x, q1, s1, p1.scale, p1.zero_point, b1)
    h = k._post(h.clone(), post)
    p2 = qparams(float(h.min()), float(h.max()), False)
    hq = op(x, q1, s1, p1.scale, p1.zero_point, b1, post, p2.scale, p2.zero_point)
    assert hq.dtype == torch.uint8 and hq.shape == (*lead, mid)
    diff = (hq.int() - k.quantize_activation(h, p2.scale, p2.zero_point).int()).abs()
    assert int(diff.max()) <= 1 and float(diff.float().mean()) < 0.02
    y = op(hq, q2, s2, p2.scale, p2.zero_point, b2)
    y_float = op(h, q2, s2, p2.scale, p2.zero_point, b2)
    assert y.dtype == torch.float32 and y.shape == (*lead, n)
    assert _rel(y, y_float) < 3e-3
    exact = F.linear(k._post(F.linear(x, w1, b1), post), w2, b2)
    assert _rel(y, exact) < 0.06
