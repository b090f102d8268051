"""`opswap::conv_nnpack`: a conv2d by NNPACK (`aten::_nnpack_spatial_convolution`).

NNPACK (Dukhan, 2016) is the CPU convolution library that PyTorch ships for mobile and
x86: for small kernels it computes the convolution by Winograd F(6x6,3x3) or by FFT
tiles (8x8, 16x16) where that saves work, and by im2col + GEMM where it does not, picking
per call. PyTorch's `F.conv2d` uses it only at batch 16 and above; at batch 1 on the deep
VGG layers it was the fastest of PyTorch's routes in chapter 11's CPU table (128@112,
256@56, 512@28). This op makes it a candidate of the race (`conv.algorithm`) at any
batch, where the race measures it faster.

Exactness: Winograd and FFT tiles round differently from a direct conv, so the algorithm
is `approx` and the race's accuracy test (error at most 2x PyTorch's conv's against
float64) applies.

NNPACK's limits, refused: float32 only, the CPU, groups 1, dilation 1, conv2d, a padding
smaller than the kernel on each side, a non-empty output. It reads and writes NCHW: a
channels-last input is converted on the way in and the output converted back (the race
counts both). NNPACK must be initialised before its first call, which
`torch.backends.nnpack.is_available()` does; the op calls it (a bare
`_nnpack_spatial_convolution` in a fresh process fails without it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from opswap.kernels._layout import as_promised, channels_last_of, empty_as_promised
from opswap.kernels.conv_algorithms import (
    ConvAlgorithm,
    ConvSite,
    check_cpu_float32_conv2d,
    cpu_float32_conv2d_refusal,
    register,
)
from opswap.kernels.conv_im2col import output_sizes


@functools.cache
def available() -> str | None:
    """Why this build cannot run NNPACK, or None (and NNPACK is then initialised)."""
    if not hasattr(torch.ops.aten, "_nnpack_spatial_convolution"):
        return "this PyTorch build has no aten::_nnpack_spatial_convolution"
    if not torch.backends.nnpack.is_available():  # also initialises NNPACK
        return "this PyTorch build or CPU has no NNPACK"
    return None


def _limits(
    weight_shape: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    out: Sequence[int],
) -> str | None:
    """Why NNPACK cannot take these settings, or None."""
    if groups != 1:
        return f"NNPACK runs ungrouped convs; this one has {groups} groups"
    if any(int(d) != 1 for d in dilation):
        return f"NNPACK runs dilation 1; this conv has dilation {list(dilation)}"
    if any(int(p) >= int(k) for p, k in zip(padding, weight_shape[2:], strict=True)):
        return (
            f"NNPACK needs a padding smaller than the kernel; padding {list(padding)}, "
            f"kernel {list(weight_shape[2:])}"
        )
    if min(out) <= 0:
        return f"the output would be empty ({list(out)})"
    return None


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> list[int]:
    """The output's spatial sizes, after refusing in one sentence what NNPACK cannot run."""
    check_cpu_float32_conv2d("conv_nnpack", x, weight, groups)
    out = output_sizes(x, weight, stride, padding, dilation)
    why = _limits(weight.shape, padding, dilation, groups, out)
    if why is not None:
        raise ValueError(f"conv_nnpack cannot run this conv: {why}")
    return out


@torch.library.custom_op("opswap::conv_nnpack", mutates_args=())
def conv_nnpack(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """conv2d(x, weight, bias, stride, padding, dilation, groups) by NNPACK: float32 on the
    CPU, groups 1, dilation 1, zero padding smaller than the kernel; the output is in the
    input's memory format (channels-last or NCHW)."""
    out = _check(x, weight, stride, padding, dilation, groups)
    why = available()
    if why is not None:
        raise ValueError(f"conv_nnpack cannot run: {why}")
    fmt = channels_last_of(x) or torch.contiguous_format
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[0], *out))
    y = torch._nnpack_spatial_convolution(
        x.contiguous(),
        weight.detach().contiguous(),
        None if bias is None else bias.detach().contiguous(),
        [int(p) for p in padding],
        [int(s) for s in stride],
    )
    return as_promised(y, fmt)


@conv_nnpack.register_fake
def _fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    out = _check(x, weight, stride, padding, dilation, groups)
    y = x.new_empty((x.shape[0], weight.shape[0], *out))
    return empty_as_promised(y, channels_last_of(x) or torch.contiguous_format)


def _refuses(site: ConvSite) -> str | None:
    why = available()
    if why is not None:
        return why
    why = cpu_float32_conv2d_refusal(site, "NNPACK")
    if why is not None:
        return why
    return _limits(site.weight_shape, site.padding, site.dilation, site.groups, site.output_spatial)


ALGORITHM = register(
    ConvAlgorithm(
        name="nnpack",
        op=torch.ops.opswap.conv_nnpack.default,
        exactness="approx",
        refuses=_refuses,
        extra=ConvSite.settings,
        # NNPACK picks Winograd, FFT or GEMM per call, unseen: counted as the direct conv's
        multiplications=lambda site: site.direct_multiplications(),
        description="NNPACK's CPU convolution (Winograd F(6,3), FFT or GEMM, its choice)",
    )
)
