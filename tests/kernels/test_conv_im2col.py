"""opswap::conv_im2col against PyTorch's convolution: float64 to rounding, float32 within
float32's, at odd shapes, every stride/padding/dilation/groups, 1-D and 2-D."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opswap.kernels import conv_algorithms as ca
from opswap.kernels.conv_im2col import ALGORITHM, conv_im2col

CASES = [
    # (input shape, weight shape, stride, padding, dilation, groups, bias)
    ((1, 3, 11, 13), (5, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1, True),
    ((3, 6, 9, 14), (9, 2, 3, 2), (2, 2), (0, 3), (2, 2), 3, False),
    ((2, 4, 7, 5), (4, 1, 5, 1), (1, 2), (2, 0), (1, 1), 4, True),  # depthwise
    ((3, 5, 23), (7, 5, 7), (2,), (3,), (2,), 1, True),
    ((1, 6, 40), (6, 2, 63), (1,), (31,), (1,), 3, False),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_pytorch_conv(case, dtype) -> None:
    xs, ws, stride, padding, dilation, groups, with_bias = case
    torch.manual_seed(len(xs) + groups)
    x, w = torch.randn(xs, dtype=dtype), torch.randn(ws, dtype=dtype)
    b = torch.randn(ws[0], dtype=dtype) if with_bias else None
    conv = F.conv1d if len(ws) == 3 else F.conv2d
    want = conv(
        x.double(), w.double(), None if b is None else b.double(), stride, padding, dilation, groups
    )
    got = conv_im2col(x, w, b, stride, padding, dilation, groups)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=0)


def test_channels_last_input() -> None:
    x = torch.randn(2, 4, 9, 8).contiguous(memory_format=torch.channels_last)
    w = torch.randn(6, 4, 3, 3)
    got = conv_im2col(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    torch.testing.assert_close(got, F.conv2d(x, w, None, 1, 1), atol=1e-4, rtol=1e-4)
    assert got.is_contiguous()


def test_bad_inputs_are_one_sentence() -> None:
    with pytest.raises(ValueError, match="5 channels, the weight expects 2 x 2 groups"):
        conv_im2col(
            torch.randn(1, 5, 6, 6), torch.randn(4, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], 2
        )
    with pytest.raises(ValueError, match="conv1d or conv2d"):
        conv_im2col(
            torch.randn(1, 2, 4, 4, 4),
            torch.randn(2, 2, 1, 1, 1),
            None,
            [1] * 3,
            [0] * 3,
            [1] * 3,
            1,
        )


def test_registered_as_exact_algorithm_with_direct_multiplications() -> None:
    assert ca.get("im2col") is ALGORITHM and ALGORITHM.exactness == "exact"
    x, w = torch.randn(2, 6, 10, 7), torch.randn(4, 3, 3, 3)
    site = ca.site_of(x, w, (1, 2), (1, 1), (1, 1), 2)
    assert ALGORITHM.refuses(site) is None
    assert ALGORITHM.multiplications(site) == site.direct_multiplications()
    y = ALGORITHM(x, w, None, site)
    torch.testing.assert_close(y, F.conv2d(x, w, None, (1, 2), 1, 1, 2), atol=1e-4, rtol=1e-4)


def test_exports_through_the_fake_kernel() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 3, 3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return conv_im2col(x, self.w, None, [2, 2], [1, 1], [1, 1], 1)

    m = M()
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(m, (torch.randn(2, 3, 12, 10),), dynamic_shapes=({0: batch},))
    x = torch.randn(5, 3, 12, 10)
    torch.testing.assert_close(ep.module()(x), m(x))
    assert any("conv_im2col" in str(n.target) for n in ep.graph.nodes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_matches_pytorch_conv() -> None:
    x = torch.randn(3, 6, 17, 15, device="cuda", dtype=torch.float64)
    w = torch.randn(9, 2, 3, 3, device="cuda", dtype=torch.float64)
    got = conv_im2col(x, w, None, [2, 1], [1, 1], [1, 2], 3)
    torch.testing.assert_close(got, F.conv2d(x, w, None, (2, 1), 1, (1, 2), 3))
