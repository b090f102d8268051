"""`opswap::conv_fft`: a stride-1 convolution through the FFT, for large kernels.

A direct convolution spends C/G x k (1-D) or C/G x kh x kw (2-D) multiplications on every
output value. Through the Fourier transform a convolution becomes a pointwise product, so
the cost per output value stops growing with the kernel:

    X = rfft(x)                  N x C transforms of P points       (P ~ the padded size)
    W = rfft(w)                  once per weight, cached
    Y[n, o] = sum_c X[n, c] * conj(W[o, c])   one complex product per frequency, per c
    y = irfft(Y)[crop]           N x O inverse transforms

Counting a real FFT of P points as P log2 P real multiplications (half a complex
radix-2 FFT's 2 P log2 P) and a complex product as 4, the FFT route costs
(N C + N O) P log2 P + 4 N O C/G P/2 multiplications against the direct N O C/G P k:
with many channels the pointwise products dominate, so by count the FFT wins from a
2 x 2 kernel on (C = O = 64 on 56 x 56: 3x fewer at 3 x 3, 18x at 7 x 7, 240x at 31 x 31). What
the count does not see is memory and arithmetic density: the spectra are complex, as large
as the padded input, and the product over channels is a complex GEMM of P/2 small
matrices, where a direct convolution runs one large real GEMM near the machine's peak. So
the measured crossover lies far above the counted one, and differs by machine: the race
in rule `conv.algorithm` and benchmarks/bench_conv.py measure it per target.

PyTorch's convolution is a cross-correlation, y[t] = sum_k x[t + k] w[k], not a
convolution: its spectrum is X * conj(W) (the correlation theorem), taken here instead of
flipping the kernel. A circular correlation of length L >= the padded input's length P
agrees with the linear one at every output t = 0 .. P - k (t + k never wraps). The left
padding p need not be written either: rotating the weight left by p (once, in its cached
spectrum) reads x[t - p + j] as the padded input would, and the indices -p .. -1 wrap to
L - p .. L - 1, zeros as long as L >= S + p. So the input is transformed at S + p points
(S its length), rounded up to a size with factors 2, 3 and 5 only, and never padded.
The product over channels, a complex [N, C/G] x [C/G, O/G] product per frequency, runs
as one real batched GEMM of twice the size ([Re X | Im X] against the packed weight).

Half-precision inputs are transformed in float32 (torch.fft takes float16 only for
power-of-two sizes on CUDA) and the result cast back; the error of an FFT grows with
log P, not with the kernel, and the rule accepts a site only where it stays within 2x
PyTorch's own conv in the same dtype. The output is contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from opswap.kernels._versions import version
from opswap.kernels.conv_algorithms import ConvAlgorithm, ConvSite, check_call, register

#: below this kernel size (in every spatial dim) an FFT convolution is never worth it
MIN_KERNEL = 3

# weight tensor -> (key, the conjugated spectrum [G, O/G, C/G, *freq]). Weakly keyed: a
# freed weight drops its entry; the key holds the version, so an in-place update is seen.
_SPECTRA: WeakIdKeyDictionary = WeakIdKeyDictionary()


def good_size(n: int) -> int:
    """The smallest size >= n whose only prime factors are 2, 3 and 5 (fast for any FFT)."""
    best = 1 << max(0, (n - 1).bit_length())
    f5 = 1
    while f5 < best:
        f35 = f5
        while f35 < best:
            f = f35
            while f < n:
                f *= 2
            best = min(best, f)
            f35 *= 3
        f5 *= 5
    return best


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _spectrum(
    weight: torch.Tensor,
    groups: int,
    sizes: tuple[int, ...],
    padding: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight's packed spectrum [G, F, 2 C/G, 2 O/G], cached per weight (see `_apply`):
    conj(rfftn(w)) of the weight rotated left by the padding (so the input need not be
    padded on the left), as the real matrix [[Re, Im], [-Im, Re]] per frequency."""
    key = (version(weight), groups, sizes, padding, dtype, weight.device)
    hit = _SPECTRA.get(weight)
    if hit is not None and hit[0] == key:
        return hit[1]  # type: ignore[no-any-return]
    dims = tuple(range(2, weight.dim()))
    o, cg = weight.shape[0], weight.shape[1]
    with torch.no_grad():
        w = weight.detach().to(dtype)
        grow: list[int] = []
        for size, k in zip(reversed(sizes), reversed(weight.shape[2:]), strict=True):
            grow += [0, size - k]  # F.pad lists the last dim first
        w = torch.roll(F.pad(w, grow), [-p for p in padding], dims)
        spec = torch.fft.rfftn(w, dim=dims)  # [O, C/G, *freq]
        spec = spec.reshape(groups, o // groups, cg, -1).permute(0, 3, 2, 1)  # [G, F, C/G, O/G]
        # the conjugate, negated by hand: a lazy .conj() is a flag some tracing modes drop
        re, im = spec.real, -spec.imag
        packed = torch.cat([torch.cat([re, im], -1), torch.cat([-im, re], -1)], -2).contiguous()
    _SPECTRA[weight] = (key, packed)
    return packed


def _check(x: torch.Tensor, weight: torch.Tensor, padding: Sequence[int], groups: int) -> None:
    check_call("conv_fft", x, weight, groups)
    if len(padding) != weight.dim() - 2:
        raise ValueError(
            f"conv_fft needs one padding per spatial dim ({weight.dim() - 2}); got {list(padding)}"
        )


@torch.library.custom_op("opswap::conv_fft", mutates_args=())
def conv_fft(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """conv1d/conv2d(x, weight, bias, stride=1, padding, dilation=1, groups) through the FFT;
    zero padding; the output is contiguous, in x's dtype."""
    _check(x, weight, padding, groups)
    dims = weight.dim() - 2
    work = _compute_dtype(x.dtype)
    spatial = tuple(int(v) for v in x.shape[2:])
    kernel = tuple(int(k) for k in weight.shape[2:])
    pad = tuple(int(p) for p in padding)
    out = tuple(s + 2 * p - k + 1 for s, p, k in zip(spatial, pad, kernel, strict=True))
    if min(out) < 1:
        raise ValueError(
            f"conv_fft: a kernel of {list(kernel)} does not fit the input {list(spatial)} "
            f"padded by {list(pad)}"
        )
    # S + p points keep the wrap-around (x[-p..-1] read at L-p..L-1) on zeros; see `_spectrum`
    sizes = tuple(good_size(max(s + p, m)) for s, p, m in zip(spatial, pad, out, strict=True))
    fdims = tuple(range(2, 2 + dims))
    n, o, cg = x.shape[0], weight.shape[0], weight.shape[1]
    og = o // groups
    spec_x = torch.fft.rfftn(x.to(work), s=sizes, dim=fdims)  # [N, C, *freq]
    freq = spec_x.shape[2:]
    # the product over channels as one real batched GEMM per (group, frequency):
    # [Re X | Im X] @ [[Re W, Im W], [-Im W, Re W]] = [Re Y | Im Y]
    xr = torch.view_as_real(spec_x).reshape(n, groups, cg, -1, 2)  # [N, G, C/G, F, 2]
    xr = xr.permute(1, 3, 0, 4, 2).reshape(-1, n, 2 * cg)  # [G F, N, 2 C/G]
    spec_w = _spectrum(weight, groups, sizes, pad, work)  # [G, F, 2 C/G, 2 O/G]
    yr = torch.bmm(xr, spec_w.reshape(-1, 2 * cg, 2 * og))  # [G F, N, 2 O/G]
    yr = yr.reshape(groups, -1, n, 2, og).permute(2, 0, 4, 1, 3).contiguous()  # [N, G, O/G, F, 2]
    spec_y = torch.view_as_complex(yr).reshape(n, o, *freq)
    y = torch.fft.irfftn(spec_y, s=sizes, dim=fdims)
    y = y[(..., *(slice(0, m) for m in out))]
    if bias is not None:
        y = y + bias.to(work).view(o, *([1] * dims))
    return y.to(x.dtype).contiguous()


@conv_fft.register_fake
def _fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    _check(x, weight, padding, groups)
    sizes = [
        x.shape[2 + i] + 2 * padding[i] - weight.shape[2 + i] + 1 for i in range(weight.dim() - 2)
    ]
    return x.new_empty((x.shape[0], weight.shape[0], *sizes))


def _refuses(site: ConvSite) -> str | None:
    if site.dims not in (1, 2):
        return f"the FFT convolution runs conv1d and conv2d; this is a {site.dims}-D convolution"
    if any(s != 1 for s in site.stride):
        return f"stride {list(site.stride)}: the FFT convolution needs stride 1"
    if any(d != 1 for d in site.dilation):
        return f"dilation {list(site.dilation)}: the FFT convolution needs dilation 1"
    if max(site.kernel) < MIN_KERNEL:
        return (
            f"a {'x'.join(map(str, site.kernel))} kernel is too small for an FFT to pay "
            f"(it takes kernels of {MIN_KERNEL} and more)"
        )
    return None


def multiplications(site: ConvSite) -> int:
    """Real multiplications: (N C + N O) P log2 P for the transforms (a real FFT of P points
    counted as P log2 P; the weight's is cached) and 4 per complex product, N O C/G per
    frequency bin."""
    n, c = site.input_shape[0], site.input_shape[1]
    o, cg = site.weight_shape[0], site.weight_shape[1]
    sizes = [
        good_size(max(s + p, m))  # the transform sizes `conv_fft` takes
        for s, p, m in zip(site.input_shape[2:], site.padding, site.output_spatial, strict=True)
    ]
    points = math.prod(sizes)
    bins = math.prod(sizes[:-1]) * (sizes[-1] // 2 + 1)
    transforms = (n * c + n * o) * points * max(1.0, math.log2(points))
    return int(transforms + 4 * n * o * cg * bins)


ALGORITHM = register(
    ConvAlgorithm(
        name="fft",
        op=torch.ops.opswap.conv_fft.default,
        exactness="approx",
        refuses=_refuses,
        extra=lambda site: (list(site.padding), site.groups),
        multiplications=multiplications,
        description="rfft of the padded input, a product with the weight's cached "
        "spectrum per frequency, inverse rfft, crop",
    )
)
