"""opswap::conv_nnpack (NNPACK's convolution) against PyTorch's conv in float64 at odd
shapes: stride 2, paddings 0 and 2, batch 1 and 3, non-square images, 5x5 and 1x1
kernels, both layouts; NNPACK's limits (groups, dilation, padding, dtype) refused in
words by the op and by the registry; export through the fake kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from opswap.kernels import conv_algorithms as ca
from opswap.kernels import conv_nnpack as N

pytestmark = pytest.mark.skipif(N.available() is not None, reason=str(N.available()))

CASES = [
    # (input shape, weight shape, stride, padding, bias)
    ((1, 5, 13, 9), (7, 5, 3, 3), (1, 1), (1, 1), True),
    ((3, 6, 13, 9), (4, 6, 3, 3), (2, 2), (0, 0), False),
    ((1, 4, 13, 9), (6, 4, 3, 3), (1, 2), (2, 2), True),
    ((3, 3, 9, 13), (5, 3, 5, 3), (2, 1), (2, 0), True),
    ((1, 8, 7, 6), (3, 8, 1, 1), (1, 1), (0, 0), False),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[:2]) for c in CASES])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_matches_a_float64_conv(case, layout: str) -> None:
    xs, ws, stride, padding, with_bias = case
    gen = torch.Generator().manual_seed(xs[0] * 10 + ws[0])
    x = torch.randn(xs, generator=gen)
    w = torch.randn(ws, generator=gen) / (ws[1] * ws[2] * ws[3]) ** 0.5
    b = torch.randn(ws[0], generator=gen) if with_bias else None
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    got = N.conv_nnpack(x, w, b, stride, padding, [1, 1], 1)
    b64 = None if b is None else b.double()
    want = F.conv2d(x.double(), w.double(), b64, stride, padding)
    assert got.dtype == torch.float32 and got.shape == want.shape
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert got.is_contiguous(memory_format=fmt)
    # NNPACK may take Winograd or FFT tiles: float32 rounding, a little more than direct
    torch.testing.assert_close(got.double(), want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_works_in_a_fresh_process_without_a_prior_nnpack_call() -> None:
    # aten's op fails in a process where nothing initialised NNPACK; the op does it
    code = (
        "import torch, opswap.kernels.conv_nnpack as N;"
        "x, w = torch.randn(1, 4, 9, 7), torch.randn(3, 4, 3, 3);"
        "y = N.conv_nnpack(x, w, None, [1, 1], [1, 1], [1, 1], 1);"
        "assert torch.allclose(y, torch.nn.functional.conv2d(x, w, None, 1, 1), atol=1e-4)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]


def test_limits_are_refused_in_one_sentence() -> None:
    x, w = torch.randn(1, 4, 9, 7), torch.randn(4, 2, 3, 3)
    with pytest.raises(ValueError, match="NNPACK runs ungrouped convs; this one has 2 groups"):
        N.conv_nnpack(x, w, None, [1, 1], [1, 1], [1, 1], 2)
    w = torch.randn(4, 4, 3, 3)
    with pytest.raises(
        ValueError, match=r"NNPACK runs dilation 1; this conv has dilation \[2, 2\]"
    ):
        N.conv_nnpack(x, w, None, [1, 1], [1, 1], [2, 2], 1)
    with pytest.raises(ValueError, match="padding smaller than the kernel"):
        N.conv_nnpack(x, w, None, [1, 1], [3, 1], [1, 1], 1)
    with pytest.raises(ValueError, match="the output would be empty"):
        N.conv_nnpack(torch.randn(1, 4, 2, 2), w, None, [1, 1], [0, 0], [1, 1], 1)
    with pytest.raises(ValueError, match="conv_nnpack runs float32; the input is torch.float64"):
        N.conv_nnpack(x.double(), w.double(), None, [1, 1], [1, 1], [1, 1], 1)


def test_the_registry_refuses_what_nnpack_cannot_run() -> None:
    a = ca.get("nnpack")
    assert a is N.ALGORITHM and a.exactness == "approx"
    ok = ca.site_of(torch.randn(3, 4, 13, 9), torch.randn(6, 4, 3, 3), (2, 2), (2, 0), (1, 1), 1)
    assert a.refuses(ok) is None
    depthwise = ca.site_of(
        torch.randn(1, 4, 9, 7), torch.randn(4, 1, 3, 3), (1, 1), (1, 1), (1, 1), 4
    )
    assert "4 groups" in str(a.refuses(depthwise))
    dilated = ca.site_of(
        torch.randn(1, 4, 9, 7), torch.randn(4, 4, 3, 3), (1, 1), (2, 2), (2, 2), 1
    )
    assert "dilation" in str(a.refuses(dilated))
    one_d = ca.site_of(torch.randn(1, 4, 9), torch.randn(6, 4, 3), (1,), (1,), (1,), 1)
    assert "1-D" in str(a.refuses(one_d))


def test_exports_through_the_fake_kernel() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 4, 3, 3), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return N.conv_nnpack(x, self.w, None, [2, 1], [1, 2], [1, 1], 1)

    x, net = torch.randn(2, 4, 13, 9), Net()
    ep = torch.export.export(net, (x,))
    assert any("conv_nnpack" in str(n.target) for n in ep.graph.nodes)
    want = F.conv2d(x, net.w, None, (2, 1), (1, 2))
    torch.testing.assert_close(ep.module()(x), want, atol=1e-4, rtol=1e-4)
