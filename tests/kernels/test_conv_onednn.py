"""opswap::conv_onednn (oneDNN on a weight packed once, channels-last) against PyTorch's
conv in float64 at odd shapes: strides, paddings 0 and 2, dilation 2, groups 2 and
depthwise, batch 1 and 3, non-square images; the output's layout, the weight cache (packed
once, repacked after an in-place write), the refusals, the registry entry and export."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opswap.kernels import conv_algorithms as ca
from opswap.kernels import conv_onednn as O

pytestmark = pytest.mark.skipif(O.available() is not None, reason=str(O.available()))

CASES = [
    # (input shape, weight shape, stride, padding, dilation, groups, bias)
    ((1, 5, 13, 9), (7, 5, 3, 3), (1, 1), (1, 1), (1, 1), 1, True),
    ((3, 6, 13, 9), (4, 3, 3, 3), (2, 2), (0, 0), (1, 1), 2, False),
    ((1, 4, 13, 9), (6, 4, 3, 3), (1, 2), (2, 2), (2, 2), 1, True),
    ((3, 8, 9, 13), (8, 1, 3, 3), (2, 1), (1, 2), (1, 1), 8, True),  # depthwise
    ((1, 3, 11, 7), (5, 3, 5, 3), (1, 1), (2, 0), (1, 2), 1, False),
]


def _draw(case, seed: int = 0):
    xs, ws, *_, with_bias = case
    gen = torch.Generator().manual_seed(seed + xs[0] * 10 + ws[0])
    x = torch.randn(xs, generator=gen)
    w = torch.randn(ws, generator=gen) / (ws[1] * ws[2] * ws[3]) ** 0.5
    b = torch.randn(ws[0], generator=gen) if with_bias else None
    return x, w, b


def _want(x, w, b, stride, padding, dilation, groups):
    b64 = None if b is None else b.double()
    return F.conv2d(x.double(), w.double(), b64, stride, padding, dilation, groups)


@pytest.mark.parametrize("case", CASES, ids=[str(c[:2]) for c in CASES])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_matches_a_float64_conv(case, layout: str) -> None:
    x, w, b = _draw(case)
    stride, padding, dilation, groups = case[2:6]
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    got = O.conv_onednn(x, w, b, stride, padding, dilation, groups)
    want = _want(x, w, b, stride, padding, dilation, groups)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # the output keeps the input's format: a channels-last model pays no conversion
    if layout == "channels_last":
        assert got.is_contiguous(memory_format=torch.channels_last)
    else:
        assert got.is_contiguous()
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=0)
    # as close to float64 as PyTorch's own float32 conv, within a small factor
    theirs = F.conv2d(x, w, b, stride, padding, dilation, groups).double()
    err = float((got.double() - want).norm() / want.norm())
    assert err <= 4 * float((theirs - want).norm() / want.norm()) + 1e-7


def test_the_weight_is_packed_once_and_again_after_an_in_place_write() -> None:
    x, w, b = _draw(CASES[0])
    w = torch.nn.Parameter(w, requires_grad=False)
    O.conv_onednn(x, w, b, [1, 1], [1, 1], [1, 1], 1)
    packed = next(iter(O._PACKED[w].values()))
    O.conv_onednn(x, w, b, [1, 1], [1, 1], [1, 1], 1)
    assert next(iter(O._PACKED[w].values())) is packed and len(O._PACKED[w]) == 1
    with torch.no_grad():
        w.mul_(-2.0)
    got = O.conv_onednn(x, w, b, [1, 1], [1, 1], [1, 1], 1)
    torch.testing.assert_close(got, F.conv2d(x, w, b, 1, 1), atol=1e-4, rtol=1e-4)
    # a batch of another size packs for that shape; at most MAX_PACKED are kept
    for n in range(2, 3 + O.MAX_PACKED):
        xn = torch.randn(n, *x.shape[1:])
        got = O.conv_onednn(xn, w, b, [1, 1], [1, 1], [1, 1], 1)
        torch.testing.assert_close(got, F.conv2d(xn, w, b, 1, 1), atol=1e-4, rtol=1e-4)
    assert len(O._PACKED[w]) == O.MAX_PACKED


def test_an_empty_batch_gives_an_empty_output() -> None:
    got = O.conv_onednn(
        torch.randn(0, 3, 7, 5), torch.randn(4, 3, 3, 3), None, [1, 1], [1, 1], [1, 1], 1
    )
    assert got.shape == (0, 4, 7, 5)


def test_bad_inputs_are_one_sentence() -> None:
    w = torch.randn(4, 3, 3, 3)
    with pytest.raises(ValueError, match="conv_onednn runs float32; the input is torch.float64"):
        O.conv_onednn(torch.randn(1, 3, 5, 5).double(), w.double(), None, [1, 1], [0, 0], [1, 1], 1)
    with pytest.raises(ValueError, match="conv_onednn runs conv2d only"):
        O.conv_onednn(torch.randn(1, 3, 9), torch.randn(4, 3, 3), None, [1], [0], [1], 1)
    with pytest.raises(ValueError, match="5 channels, the weight expects 3 x 1 groups"):
        O.conv_onednn(torch.randn(1, 5, 6, 6), w, None, [1, 1], [0, 0], [1, 1], 1)


def test_the_registry_refuses_what_the_op_cannot_run() -> None:
    a = ca.get("onednn_prepacked")
    assert a is O.ALGORITHM and a.exactness == "exact"
    site = ca.site_of(torch.randn(1, 4, 9, 7), torch.randn(6, 2, 3, 3), (2, 1), (1, 0), (2, 1), 2)
    assert a.refuses(site) is None
    assert a.multiplications(site) == site.direct_multiplications()
    one_d = ca.site_of(torch.randn(1, 4, 9), torch.randn(6, 4, 3), (1,), (1,), (1,), 1)
    assert "runs conv2d; this is a 1-D convolution" in str(a.refuses(one_d))
    half = ca.ConvSite((1, 4, 9, 7), (6, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.bfloat16, "cpu")
    assert "raced in float32; this site is torch.bfloat16" in str(a.refuses(half))
    gpu = ca.ConvSite((1, 4, 9, 7), (6, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.float32, "cuda")
    assert "runs on the CPU" in str(a.refuses(gpu))


def test_exports_through_the_fake_kernel() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 4, 3, 3), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return O.conv_onednn(x, self.w, None, [2, 1], [1, 2], [1, 1], 1)

    x, net = torch.randn(2, 4, 13, 9), Net()
    ep = torch.export.export(net, (x,))
    assert any("conv_onednn" in str(n.target) for n in ep.graph.nodes)
    want = F.conv2d(x, net.w, None, (2, 1), (1, 2))
    torch.testing.assert_close(ep.module()(x), want, atol=1e-4, rtol=1e-4)
