"""`opswap::conv_im2col`: a convolution as an explicit unfold (im2col) and one GEMM.

The oldest way to run a convolution on hardware that has a fast matrix multiply and no
convolution primitive: copy every receptive field of the input into a column
(`F.unfold`), so that the convolution becomes one matrix product per group,

    cols: [N, G, C/G * kh * kw, Ho * Wo]     (the unfolded input)
    w:    [G, O/G, C/G * kh * kw]            (the weight, as it is stored, reshaped)
    y = w @ cols: [N, G, O/G, Ho * Wo]        -> [N, O, Ho, Wo]

The multiplications are the direct convolution's, N x O x Ho x Wo x C/G x kh x kw, so
the arithmetic is unchanged; what it costs is memory: the column matrix holds every input
pixel kh x kw times (9x the input for a 3x3 conv at stride 1), written once and read once
by the GEMM. Where the GEMM is much faster than the target's convolution (or there is no
convolution at all) it pays; against cuDNN or oneDNN, which tile the same product without
materialising the columns, it usually loses, and the race (rule `conv.algorithm`) says so.
It is chapter 11's baseline: exact (the same products, summed in another order).

1-D convolutions run as 2-D ones over a height of one. The output is always contiguous
(NCHW), whatever the input's memory format: the GEMM's result is laid out so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from opswap.kernels.conv_algorithms import ConvAlgorithm, ConvSite, check_call, register


def output_size(
    size: int, k: int, stride: int, padding: int, dilation: int
) -> int:  # SymInt-safe: plain arithmetic
    return (size + 2 * padding - dilation * (k - 1) - 1) // stride + 1


def output_sizes(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> list[int]:
    """The output's spatial sizes of a convolution of `x` by `weight`."""
    return [
        output_size(x.shape[2 + i], weight.shape[2 + i], stride[i], padding[i], dilation[i])
        for i in range(weight.dim() - 2)
    ]


def _as_2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A 1-D convolution's tensors and settings as a 2-D one of height 1; 2-D unchanged."""
    if weight.dim() == 3:
        return (
            x.unsqueeze(2),
            weight.unsqueeze(2),
            (1, int(stride[0])),
            (0, int(padding[0])),
            (1, int(dilation[0])),
        )
    return (
        x,
        weight,
        tuple(int(s) for s in stride),
        tuple(int(p) for p in padding),
        tuple(int(d) for d in dilation),
    )


@torch.library.custom_op("opswap::conv_im2col", mutates_args=())
def conv_im2col(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """conv1d/conv2d(x, weight, bias, stride, padding, dilation, groups) by unfold + GEMM;
    zero padding; the output is contiguous."""
    check_call("conv_im2col", x, weight, groups)
    one_d = weight.dim() == 3
    x2, w2, s, p, d = _as_2d(x, weight, stride, padding, dilation)
    n = x2.shape[0]
    o, cg, kh, kw = w2.shape
    ho = output_size(x2.shape[2], kh, s[0], p[0], d[0])
    wo = output_size(x2.shape[3], kw, s[1], p[1], d[1])
    # cols: [N, C * kh * kw, Ho * Wo], channel-major, as the weight's rows are
    cols = F.unfold(x2, (kh, kw), dilation=d, padding=p, stride=s)
    cols = cols.view(n, groups, cg * kh * kw, ho * wo)
    w = w2.reshape(groups, o // groups, cg * kh * kw)
    y = torch.matmul(w, cols)  # [N, G, O/G, Ho * Wo]: one batched GEMM over N and G
    if bias is not None:
        y = y + bias.view(groups, o // groups, 1).to(y.dtype)
    y = y.reshape(n, o, ho, wo)
    return y.squeeze(2) if one_d else y


@conv_im2col.register_fake
def _fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    check_call("conv_im2col", x, weight, groups)
    sizes = [
        output_size(x.shape[2 + i], weight.shape[2 + i], stride[i], padding[i], dilation[i])
        for i in range(weight.dim() - 2)
    ]
    return x.new_empty((x.shape[0], weight.shape[0], *sizes))


def _refuses(site: ConvSite) -> str | None:
    if site.dims not in (1, 2):
        return f"im2col runs conv1d and conv2d; this is a {site.dims}-D convolution"
    return None


def _multiplications(site: ConvSite) -> int:
    # the GEMM does the direct convolution's products, no more and no fewer
    return site.direct_multiplications()


def column_bytes(site: ConvSite) -> int:
    """Bytes of the column matrix: each output pixel's receptive field, per sample."""
    c = site.weight_shape[1] * site.groups
    per = torch.empty((), dtype=site.dtype).element_size()
    return site.input_shape[0] * c * math.prod(site.kernel) * math.prod(site.output_spatial) * per


ALGORITHM = register(
    ConvAlgorithm(
        name="im2col",
        op=torch.ops.opswap.conv_im2col.default,
        exactness="exact",
        refuses=_refuses,
        extra=ConvSite.settings,
        multiplications=_multiplications,
        description="explicit unfold of every receptive field, then one GEMM per group",
    )
)
