"""opswap::conv_fft against PyTorch's convolution (a cross-correlation: the kernel is not
flipped), at odd shapes, long 1-D kernels, groups, every padding; the weight's cached
spectrum follows in-place updates; stride and dilation are refused by the algorithm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opswap.kernels import conv_algorithms as ca
from opswap.kernels._conv_error import error_against_float64
from opswap.kernels.conv_fft import ALGORITHM, conv_fft, good_size, multiplications

CASES = [
    # (input shape, weight shape, padding, groups, bias)
    ((1, 3, 11, 13), (5, 3, 7, 7), (3, 3), 1, True),
    ((3, 6, 19, 9), (4, 3, 5, 3), (0, 2), 2, False),
    ((2, 4, 15, 16), (4, 1, 9, 9), (1, 0), 4, True),  # depthwise
    ((3, 5, 200), (7, 5, 63), (2,), 1, True),  # a long 1-D kernel
    ((1, 6, 97), (6, 1, 31), (15,), 6, False),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_pytorch_conv(case, dtype) -> None:
    xs, ws, padding, groups, with_bias = case
    torch.manual_seed(len(xs) + groups)
    x, w = torch.randn(xs, dtype=dtype), torch.randn(ws, dtype=dtype)
    b = torch.randn(ws[0], dtype=dtype) if with_bias else None
    conv = F.conv1d if len(ws) == 3 else F.conv2d
    want = conv(x.double(), w.double(), None if b is None else b.double(), 1, padding, 1, groups)
    got = conv_fft(x, w, b, padding, groups)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=0)


def test_an_asymmetric_kernel_is_not_flipped() -> None:
    # a kernel that only picks x[t + 2]: a flipped one would pick x[t]
    x = torch.randn(1, 1, 10, dtype=torch.float64)
    w = torch.tensor([[[0.0, 0.0, 1.0]]], dtype=torch.float64)
    torch.testing.assert_close(conv_fft(x, w, None, [0], 1)[0, 0], x[0, 0, 2:])


def test_the_cached_spectrum_sees_an_in_place_weight_update() -> None:
    x, w = torch.randn(2, 3, 20, dtype=torch.float64), torch.randn(4, 3, 5, dtype=torch.float64)
    conv_fft(x, w, None, [2], 1)
    with torch.no_grad():
        w.mul_(-2.0)
    torch.testing.assert_close(conv_fft(x, w, None, [2], 1), F.conv1d(x, w, None, 1, 2))


def test_half_is_computed_in_float32_within_twice_pytorchs_error() -> None:
    site = ca.site_of(
        torch.empty(2, 8, 21, 17, dtype=torch.float16),
        torch.empty(8, 8, 7, 7, dtype=torch.float16),
        (1, 1), (3, 3), (1, 1), 1,
    )  # fmt: skip
    mine, theirs = error_against_float64(ALGORITHM, site)
    assert mine <= 2 * theirs, (mine, theirs)


def test_the_algorithm_refuses_stride_dilation_and_small_kernels_in_one_sentence() -> None:
    x = torch.empty(1, 4, 16, 16)
    w = torch.empty(4, 4, 7, 7)
    assert ALGORITHM.refuses(ca.site_of(x, w, (1, 1), (3, 3), (1, 1), 1)) is None
    assert "needs stride 1" in str(ALGORITHM.refuses(ca.site_of(x, w, (2, 2), (3, 3), (1, 1), 1)))
    assert "needs dilation 1" in str(ALGORITHM.refuses(ca.site_of(x, w, (1, 1), (3, 3), (2, 1), 1)))
    small = ca.site_of(x, torch.empty(4, 4, 1, 1), (1, 1), (0, 0), (1, 1), 1)
    assert "too small for an FFT" in str(ALGORITHM.refuses(small))


def test_multiplications_count_grows_slower_than_the_direct_convolution() -> None:
    x = torch.empty(1, 64, 56, 56)
    sites = [
        ca.site_of(x, torch.empty(64, 64, k, k), (1, 1), (k // 2, k // 2), (1, 1), 1)
        for k in (7, 31)
    ]
    ratio = [s.direct_multiplications() / multiplications(s) for s in sites]
    assert 1 < ratio[0] < ratio[1]


def test_good_sizes_have_only_factors_2_3_5() -> None:
    for n in (1, 7, 13, 62, 97, 1021, 4097):
        m = good_size(n)
        assert m >= n
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        assert m == 1


def test_bad_inputs_are_one_sentence() -> None:
    with pytest.raises(ValueError, match="does not fit the input"):
        conv_fft(torch.randn(1, 2, 5), torch.randn(2, 2, 9), None, [1], 1)
    with pytest.raises(ValueError, match="one padding per spatial dim"):
        conv_fft(torch.randn(1, 2, 5, 5), torch.randn(2, 2, 3, 3), None, [1], 1)


def test_compiles_with_a_dynamic_batch() -> None:
    w = torch.randn(3, 2, 9)

    def f(x: torch.Tensor) -> torch.Tensor:
        return conv_fft(x, w, None, [4], 1)

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (2, 5):
        x = torch.randn(n, 2, 30)
        torch.testing.assert_close(compiled(x), F.conv1d(x, w, None, 1, 4), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_on_cuda_within_twice_pytorchs_error(dtype: torch.dtype) -> None:
    for xs, ws, pad in (
        ((2, 8, 33, 31), (8, 8, 9, 9), (4, 4)),
        ((3, 16, 500), (16, 16, 63), (31,)),
    ):
        site = ca.ConvSite(xs, ws, (1,) * len(pad), pad, (1,) * len(pad), 1, dtype, "cuda")
        mine, theirs = error_against_float64(ALGORITHM, site)
        assert mine <= 2 * max(theirs, 1e-6), (xs, mine, theirs)
