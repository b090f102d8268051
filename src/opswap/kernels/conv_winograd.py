"""`opswap::conv_winograd`: a stride-1 3x3 convolution by Winograd's minimal filtering,
F(2x2,3x3) and F(4x4,3x3) (Lavin & Gray, "Fast Algorithms for Convolutional Neural
Networks", 2015). Inference only: the op has no autograd, and the registry's `approx`
algorithms are raced for inference sites only; do not use it where the model trains.

How it saves multiplications. The output is cut into m x m tiles; each reads an
a x a input tile (a = m + 2). Per tile and per (input channel, output channel) pair the
direct convolution does m^2 * 9 multiplications; Winograd does a^2 element-wise products
between the transformed input tile V = B^T d B and the transformed filter U = G g G^T,
then takes Y = A^T (sum over C of U * V) A:

    F(2x2,3x3): 4 * 9 = 36 against 16 products  (2.25x fewer)
    F(4x4,3x3): 16 * 9 = 144 against 36         (4x fewer)

Summed over the input channels, the products are a^2 independent GEMMs, one per point
of the transform: [tiles x C] @ [C x O]. On the CPU they run as one batched torch.matmul
(float32 accumulation, half inputs included); on CUDA a Triton kernel runs them, one
program per (point, block of tiles, block of output channels), tl.dot over C. The input
and output transforms are additions and a few scalings (counted separately, `transform_
multiplications`); the filter transform is done once per weight and cached (by the
weight's identity and version, so an in-place update is seen).

On CUDA the input and output transforms run as two GEMMs by the Kronecker products of
the matrices (a handful of kernels a call, where the additions would be some forty), then
the products by the Triton kernel. Not done yet: fusing the input transform into the
products' kernel. Computing one point's V inside the (point, tiles, O) program costs a^2
CUDA-core FMAs per element, redone for every block of O, against the tensor cores' one
product: it would make the kernel slower, not faster. The fusion that pays computes all
a^2 points of a tile block in one program (a^2 accumulators), as cuDNN's Winograd does.

The price is precision. F(4,3) uses the points 0, +-1, +-2 (and infinity); its matrices
hold 4, 5 and 1/24, so a transformed tile mixes values of very different size and a
rounding of V or U in a low-precision dtype costs digits (benchmarks/bench_winograd.py
measures how many). The CPU path computes in float32 for float16/bfloat16 inputs; the
Triton path rounds V and U to the input's dtype for the tensor cores, and accumulates and
transforms back in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.library import wrap_triton
from torch.utils.weak import WeakIdKeyDictionary

from opswap.kernels._layout import as_promised, channels_last_of
from opswap.kernels._rows import _is_fake, interpreting, jitted, runs_triton, tl
from opswap.kernels._triton_op import triton_op
from opswap.kernels._versions import version
from opswap.kernels._winograd import (
    _RAW,
    WinogradError,
    _check_m,
    _tiles,
    filter_transform,
    input_transform,
    input_transform_gemm,
    output_transform,
    output_transform_gemm,
)
from opswap.kernels._winograd import (
    TILES as TILES,
)
from opswap.kernels.conv_algorithms import ConvAlgorithm, ConvSite, register

# weight tensor -> (key, U). Weakly keyed: a freed weight drops its entry.
_U_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _cached_filter(weight: torch.Tensor, m: int, groups: int) -> torch.Tensor:
    """filter_transform, done once per weight (and again after an in-place write to it).
    Traced weights (torch.compile, torch.export, fake tensors) are not cached: the
    transform is then part of the traced graph."""
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or _is_fake(weight):
        return filter_transform(weight, m, groups)
    key = (version(weight), m, groups, weight.dtype, weight.device)
    hit = _U_CACHE.get(weight)
    if hit is not None and hit[0] == key:
        return hit[1]  # type: ignore[no-any-return]
    with torch.no_grad():
        u = filter_transform(weight.detach(), m, groups)
    _U_CACHE[weight] = (key, u)
    return u


# ----------------------------------------------------------------------------- Triton


# The products, one program per (point of the transform, block of tiles, block of output
# channels): [BLOCK_T x C] @ [C x BLOCK_O] by tl.dot, C in steps of BLOCK_C. A point's GEMM
# is 2 * tiles * C * O flops over (tiles * C + C * O) * 2 bytes of half inputs: for
# ResNet's 3x3 layers (C = O = 64..512) 32..256 flops a byte, on the tensor cores' side of
# an H100's ridge, so the products run as GEMMs do; Winograd's gain is a^2 / (9 m^2) of
# the direct conv's flops, paid for by the transforms' memory passes.
# No annotations on the runtime arguments: a compiling Triton resolves them as globals
# and refuses `Any` (the interpreter never looks), so the GPU build failed on them.
def _products_fn(  # type: ignore[no-untyped-def]
    v_ptr,  # [P, T, Cg] (P = points x groups), contiguous
    u_ptr,  # [P, Cg, Og], contiguous
    out_ptr,  # [P, T, Og] float32, contiguous
    T,
    C,
    OUT,  # Og
    BLOCK_T: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" or "tf32" for float32
    DOT_F32: tl.constexpr,  # the interpreter's bfloat16 tl.dot is wrong (Triton 3.9): fp32
) -> None:
    p = tl.program_id(0).to(tl.int64)
    rt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ro = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    rc = tl.arange(0, BLOCK_C)
    v_base = v_ptr + p * T * C
    u_base = u_ptr + p * C * OUT
    acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + rc
        a = tl.load(
            v_base + rt[:, None].to(tl.int64) * C + cc[None, :],
            mask=(rt[:, None] < T) & (cc[None, :] < C),
            other=0.0,
        )
        b = tl.load(
            u_base + cc[:, None] * OUT + ro[None, :],
            mask=(cc[:, None] < C) & (ro[None, :] < OUT),
            other=0.0,
        )
        if DOT_F32:  # the operands hold half values already: the same products
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = out_ptr + p * T * OUT + rt[:, None].to(tl.int64) * OUT + ro[None, :]
    tl.store(out, acc, mask=(rt[:, None] < T) & (ro[None, :] < OUT))


def _block(n: int, most: int) -> int:
    """A power-of-two block of at least 16 (tl.dot's least) and at most `most`."""
    return max(16, min(most, 1 << max(0, n - 1).bit_length()))


def triton_products(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The a*a*groups GEMMs v [P, T, Cg] @ u [P, Cg, Og] -> [P, T, Og] in float32, by the
    Triton kernel (operands in their own dtype, float32 accumulation)."""
    p, t, c = v.shape
    o = u.shape[2]
    out = torch.empty((p, t, o), device=v.device, dtype=torch.float32)
    if p and t and o:
        bt, bo, bc = _block(t, 64), _block(o, 64), _block(c, 32)
        precision = (
            "tf32" if v.dtype == torch.float32 and torch.backends.cudnn.allow_tf32 else "ieee"
        )
        grid = (p, -(-t // bt), -(-o // bo))
        wrap_triton(jitted(_products_fn))[grid](
            v.contiguous(),
            u.contiguous(),
            out,
            t,
            c,
            o,
            BLOCK_T=bt,
            BLOCK_O=bo,
            BLOCK_C=bc,
            PRECISION=precision if v.dtype == torch.float32 and not interpreting() else "ieee",
            DOT_F32=interpreting(),
            num_warps=4,
        )
    return out


# ----------------------------------------------------------------------------- the op


def check_call(
    x: torch.Tensor, weight: torch.Tensor, padding: Sequence[int], groups: int, m: int
) -> None:
    """One-sentence refusals of what the op cannot compute."""
    _check_m(m)
    if x.dim() != 4 or weight.dim() != 4:
        raise WinogradError(
            f"Winograd here computes 2-D convolutions (a 4-D input and weight); got a "
            f"{x.dim()}-D input and a {weight.dim()}-D weight."
        )
    if tuple(weight.shape[2:]) != (3, 3):
        k = "x".join(str(s) for s in weight.shape[2:])
        raise WinogradError(f"kernel {k}: Winograd F({m}x{m},3x3) needs a 3x3 kernel.")
    if len(padding) != 2 or any(p < 0 for p in padding):
        raise WinogradError(f"padding {list(padding)} must be two non-negative sizes (H, W).")
    c, o = x.shape[1], weight.shape[0]
    if groups < 1 or c % groups or o % groups or weight.shape[1] * groups != c:
        raise WinogradError(
            f"groups={groups} does not fit {c} input and {o} output channels with a weight of "
            f"{weight.shape[1]} channels a group."
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise WinogradError(f"dtype {x.dtype} is not a floating type Winograd computes in.")
    ho, wo, _, _ = _tiles(x.shape[2], x.shape[3], padding, m)
    if ho < 1 or wo < 1:
        raise WinogradError(
            f"an input of {x.shape[2]}x{x.shape[3]} with padding {list(padding)} is smaller "
            "than the 3x3 kernel."
        )


def output_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """Channels-last where x or the weight is laid out so (as ATen's conv decides),
    contiguous otherwise; the fake kernel gives the same."""
    return channels_last_of(x) or channels_last_of(weight) or torch.contiguous_format


def winograd_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    padding: Sequence[int],
    groups: int,
    m: int,
) -> torch.Tensor:
    """conv2d(x, weight, bias, stride=1, padding, dilation=1, groups) by Winograd
    F(m x m, 3 x 3), m in (2, 4), without the dispatcher; out in x's dtype."""
    check_call(x, weight, padding, groups, m)
    n, _, h, w = x.shape
    o = weight.shape[0]
    ho, wo, _, _ = _tiles(h, w, padding, m)
    fmt = output_format(x, weight)
    u = _cached_filter(weight, m, groups)
    triton = runs_triton(x) and x.dtype != torch.float64
    # traced (torch.compile, torch.export): the GEMM transforms too, the same numbers in a
    # dozen nodes instead of a hundred strided slices, whose symbolic sizes took a dynamic
    # compile 90 s to reason about (6 s with these); Inductor fuses the copies itself
    gemm = triton or _is_fake(x)
    v = (input_transform_gemm if gemm else input_transform)(x, padding, m, groups)
    if triton:
        # the tensor cores take V and U in the input's dtype (this rounding is where
        # F(4,3) in half precision loses digits); products and transform back in float32
        prod = triton_products(v.to(x.dtype), u.to(x.dtype))
    else:
        prod = torch.bmm(v, u)
    y = (output_transform_gemm if gemm else output_transform)(prod, (n, o, ho, wo), m, groups, fmt)
    if bias is not None:
        y = y + bias.to(y.dtype).reshape(1, o, 1, 1)
    return as_promised(y.to(x.dtype), fmt)


@triton_op("opswap::conv_winograd", mutates_args=())
def conv_winograd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    padding: Sequence[int],
    groups: int,
    m: int,
) -> torch.Tensor:
    """conv2d(x, weight, bias, stride=1, padding, dilation=1, groups) for a 3x3 kernel by
    Winograd F(m x m, 3 x 3), m in (2, 4). Inference only (no autograd)."""
    return winograd_conv2d(x, weight, bias, padding, groups, m)


# ----------------------------------------------------------------------------- the registry


def _name(m: int) -> str:
    return f"winograd_f{m}x{m}_3x3"


def refusal(site: ConvSite, m: int) -> str | None:
    """Why F(m x m, 3 x 3) cannot (or should not) run this site, in one sentence, or None."""
    what = f"Winograd F({m}x{m},3x3)"
    if site.dims != 2:
        return f"conv{site.dims}d: {what} is written for 2-D convolutions"
    if site.kernel != (3, 3):
        return f"kernel {'x'.join(map(str, site.kernel))}: {what} needs a 3x3 kernel"
    if site.stride != (1, 1):
        return f"stride {'x'.join(map(str, site.stride))}: {what} needs stride 1"
    if site.dilation != (1, 1):
        return f"dilation {'x'.join(map(str, site.dilation))}: {what} needs dilation 1"
    if site.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {site.dtype}: {what} runs float32, float16 and bfloat16"
    if site.device not in ("cpu", "cuda"):
        return f"device {site.device}: {what} runs on the CPU and CUDA"
    if site.groups > 1 and site.weight_shape[1] == 1:
        return (
            f"depthwise: with one input channel a group, {what}'s products are element-wise, "
            "and its transforms cost more memory traffic than the multiplications they save"
        )
    if any(s < 1 for s in site.output_spatial):
        return "the input is smaller than the 3x3 kernel"
    return None


def products(site: ConvSite, m: int) -> int:
    """The element-wise products of F(m x m, 3 x 3) at the site: (m+2)^2 per tile per
    (input channel of a group, output channel) pair, over every tile of every image.
    The transforms' multiplications are not counted (`transform_multiplications`)."""
    ho, wo = site.output_spatial
    tiles = -(-ho // m) * -(-wo // m)
    n, o, cg = site.input_shape[0], site.weight_shape[0], site.weight_shape[1]
    return n * tiles * (m + 2) ** 2 * cg * o


def transform_multiplications(site: ConvSite, m: int) -> int:
    """The multiplications of the input and output transforms by a coefficient other than
    0 or +-1, as the matrices are applied along each axis (the filter transform is done
    once per weight and not counted)."""
    bt, _, at = _RAW[m]
    a = m + 2

    def scaled(mat: list[list[Any]]) -> int:
        return sum(1 for row in mat for v in row if v not in (0, 1, -1))

    ho, wo = site.output_spatial
    tiles = -(-ho // m) * -(-wo // m)
    n, c, o = site.input_shape[0], site.input_shape[1], site.weight_shape[0]
    per_input_tile = scaled(bt) * a * 2  # B^T along the rows (a columns), then the columns
    per_output_tile = scaled(at) * a + scaled(at) * m
    return n * tiles * (c * per_input_tile + o * per_output_tile)


def _algorithm(m: int) -> ConvAlgorithm:
    return ConvAlgorithm(
        name=_name(m),
        op=torch.ops.opswap.conv_winograd.default,
        exactness="approx",
        refuses=lambda site: refusal(site, m),
        extra=lambda site: (list(site.padding), site.groups, m),
        multiplications=lambda site: products(site, m),
        chapter=11,
        description=(
            f"Winograd F({m}x{m},3x3): {(m + 2) ** 2} products per {m}x{m} output tile "
            f"instead of {9 * m * m} ({9 * m * m / (m + 2) ** 2:.2f}x fewer); inference only"
        ),
    )


F2X2_3X3 = register(_algorithm(2))
F4X4_3X3 = register(_algorithm(4))
