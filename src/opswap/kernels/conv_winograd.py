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
from fractions import Fraction
from typing import Any

import torch
from torch.library import wrap_triton
from torch.utils.weak import WeakIdKeyDictionary

from opswap.errors import OpswapError
from opswap.kernels._layout import as_promised, channels_last_of
from opswap.kernels._rows import _is_fake, interpreting, jitted, runs_triton, tl
from opswap.kernels._triton_op import triton_op
from opswap.kernels._versions import version
from opswap.kernels.conv_algorithms import ConvAlgorithm, ConvSite, register

#: output tile sizes m of F(m x m, 3 x 3) this module implements
TILES = (2, 4)


class WinogradError(OpswapError, ValueError):
    """A convolution or setting the Winograd op cannot take."""


# ----------------------------------------------------------------------------- the matrices

_Q = Fraction
_Mat = list[list[Any]]
# F(2,3), Lavin & Gray: points 0, 1, -1 and infinity
_BT2: _Mat = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
_G2: _Mat = [[1, 0, 0], [_Q(1, 2), _Q(1, 2), _Q(1, 2)], [_Q(1, 2), _Q(-1, 2), _Q(1, 2)], [0, 0, 1]]
_AT2: _Mat = [[1, 1, 1, 0], [0, 1, -1, -1]]
# F(4,3): points 0, 1, -1, 2, -2 and infinity. Rows of A^T are the powers of the points
# (0..3; infinity picks the last coefficient); G's rows are the filter polynomial at each
# point divided by the product of that point's differences to the others (the Lagrange
# denominators: 4, -6, -6, 24, 24, 1), and B^T's rows are the coefficients of the
# products of (x - other points), so that A^T [(G g) * (B^T d)] is the correlation.
_BT4: _Mat = [
    [4, 0, -5, 0, 1, 0],
    [0, -4, -4, 1, 1, 0],
    [0, 4, -4, -1, 1, 0],
    [0, -2, -1, 2, 1, 0],
    [0, 2, -1, -2, 1, 0],
    [0, 4, 0, -5, 0, 1],
]
_G4: _Mat = [
    [_Q(1, 4), 0, 0],
    [_Q(-1, 6), _Q(-1, 6), _Q(-1, 6)],
    [_Q(-1, 6), _Q(1, 6), _Q(-1, 6)],
    [_Q(1, 24), _Q(1, 12), _Q(1, 6)],
    [_Q(1, 24), _Q(-1, 12), _Q(1, 6)],
    [0, 0, 1],
]
_AT4: _Mat = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]
_RAW: dict[int, tuple[_Mat, _Mat, _Mat]] = {
    2: (_BT2, _G2, _AT2),
    4: (_BT4, _G4, _AT4),
}


def matrices(
    m: int, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B^T [a, a], G [a, 3], A^T [m, a]) of F(m x m, 3 x 3), a = m + 2, as tensors (the
    kernels apply them as additions, `_combine`)."""
    _check_m(m)
    return tuple(  # type: ignore[return-value]
        torch.tensor([[float(v) for v in row] for row in mat], dtype=dtype, device=device)
        for mat in _RAW[m]
    )


def _check_m(m: int) -> None:
    if m not in TILES:
        raise WinogradError(f"Winograd tile size m={m} is not one of {TILES}; use 2 or 4.")


# ----------------------------------------------------------------------------- the pieces


def filter_transform(weight: torch.Tensor, m: int, groups: int) -> torch.Tensor:
    """U = G g G^T of every filter, laid out for the products: [a*a*groups, C/g, O/g]
    (point-major, then group), in float32 (float64 for float64 weights)."""
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32
    g_mat = _RAW[m][1]
    o, cg = weight.shape[0], weight.shape[1]
    a = m + 2
    w = weight.to(work)
    rows = w.new_empty((a, o, cg, 3))  # G along the filter's rows
    for i in range(a):
        _combine(g_mat[i], [w[:, :, j] for j in range(3)], rows[i])
    u = w.new_empty((a, a, o, cg))  # and along its columns
    for i in range(a):
        for j in range(a):
            _combine(g_mat[j], [rows[i][..., k] for k in range(3)], u[i, j])
    u = u.reshape(a * a, groups, o // groups, cg).transpose(2, 3)  # [a*a, g, Cg, Og]
    return u.reshape(a * a * groups, cg, o // groups).contiguous()


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


def _tiles(h: int, w: int, padding: Sequence[int], m: int) -> tuple[int, int, int, int]:
    """(output height, output width, tile rows, tile columns)."""
    ho, wo = h + 2 * padding[0] - 2, w + 2 * padding[1] - 2
    return ho, wo, -(-ho // m), -(-wo // m)


def _combine(coeffs: Sequence[Any], parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """out = sum_j coeffs[j] * parts[j], skipping zero coefficients: a row of a transform
    matrix applied as additions (its entries are small integers and a few fractions)."""
    terms = [(float(c), t) for c, t in zip(coeffs, parts, strict=True) if c != 0]
    (c0, t0), rest = terms[0], terms[1:]
    if rest and c0 == 1:
        (c1, t1), rest = rest[0], rest[1:]
        torch.add(t0, t1, alpha=c1, out=out)
    elif rest and c0 == -1 and rest[0][0] == 1:
        (_, t1), rest = rest[0], rest[1:]
        torch.sub(t1, t0, out=out)
    else:
        torch.mul(t0, c0, out=out)
    for c, t in rest:
        out.add_(t, alpha=c)


def input_transform(x: torch.Tensor, padding: Sequence[int], m: int, groups: int) -> torch.Tensor:
    """V = B^T d B of every input tile d, laid out for the products:
    [a*a*groups, N*tiles, C/g], in float32 (float64 for float64 x)."""
    n, c, h, w = x.shape
    a = m + 2
    _, _, th, tw = _tiles(h, w, padding, m)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    bt = _RAW[m][0]
    # x as [N, Hp, Wp, C] (channels last, so that the products read rows of C), zero
    # padded, with more zeros on the bottom/right so that the last tiles are whole
    hp, wp = th * m + 2, tw * m + 2
    xp = x.new_zeros((n, hp, wp, c), dtype=work)
    xp[:, padding[0] : padding[0] + h, padding[1] : padding[1] + w] = x.permute(0, 2, 3, 1)
    # B^T along the rows of every tile: rows [a_i, N, th, Wp, C]
    row_parts = [xp[:, j : j + m * (th - 1) + 1 : m] for j in range(a)]
    rows = xp.new_empty((a, n, th, wp, c))
    for i in range(a):
        _combine(bt[i], row_parts, rows[i])
    # and along its columns, all rows at once, into V [a_i, a_l, N, th, tw, C]
    col_parts = [rows[:, :, :, k : k + m * (tw - 1) + 1 : m] for k in range(a)]
    v = xp.new_empty((a, a, n, th, tw, c))
    for j in range(a):
        _combine(bt[j], col_parts, v[:, j])
    if groups == 1:
        return v.reshape(a * a, n * th * tw, c)
    v = v.reshape(a * a, n * th * tw, groups, c // groups).transpose(1, 2)
    return v.reshape(a * a * groups, n * th * tw, c // groups)


def output_transform(
    prod: torch.Tensor,
    shape: tuple[int, int, int, int],
    m: int,
    groups: int,
    fmt: torch.memory_format,
) -> torch.Tensor:
    """Y = A^T M A of every tile's products M ([a*a*groups, N*tiles, O/g]), assembled into
    the output [N, O, Ho, Wo] (`shape`), cropped, in memory format fmt (the channels-last
    result is a view; the caller lays it out as promised)."""
    n, o, ho, wo = shape
    a = m + 2
    th, tw = -(-ho // m), -(-wo // m)
    at = _RAW[m][2]
    if groups == 1:
        p = prod.reshape(a, a, n, th, tw, o)
    else:
        p = prod.reshape(a, a, groups, n * th * tw, o // groups).permute(0, 1, 3, 2, 4)
        p = p.reshape(a, a, n, th, tw, o)
    # A^T along the rows: z [m_r, a_l, N, th, tw, O]
    z = prod.new_empty((m, a, n, th, tw, o))
    for r in range(m):
        _combine(at[r], [p[i] for i in range(a)], z[r])
    # and along the columns, all rows at once, into the output tiles y [N, th, m_r, tw, m_s, O]
    y = prod.new_empty((n, th, m, tw, m, o))
    col_parts = [z[:, col].permute(1, 2, 0, 3, 4) for col in range(a)]  # [N, th, m_r, tw, O]
    for s_ in range(m):
        _combine(at[s_], col_parts, y[:, :, :, :, s_])
    y = y.reshape(n, th * m, tw * m, o)[:, :ho, :wo].permute(0, 3, 1, 2)
    return y if fmt == torch.channels_last else y.contiguous()


# On CUDA the transforms run as two GEMMs instead of the additions above, which would be
# some forty small kernels a call for F(4,3), their launches costing more than cuDNN's
# whole conv on ResNet's layers: all a^2 points of a tile from its a^2 values at once,
# V = (B^T kron B^T) D and Y = (A^T kron A^T) M, one gather copy before and one scatter
# copy after. Their flops (a^4 and m^2 a^2 per tile and channel) are CUDA-core work an
# H100 does in the time of the copies.
def _kron(mat: _Mat, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor([[float(v) for v in row] for row in mat], dtype=dtype, device=device)
    return torch.kron(t, t)


def input_transform_gemm(
    x: torch.Tensor, padding: Sequence[int], m: int, groups: int
) -> torch.Tensor:
    """input_transform by one GEMM: the same [a*a*groups, N*tiles, C/g] in float32."""
    n, c, h, w = x.shape
    a = m + 2
    _, _, th, tw = _tiles(h, w, padding, m)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xp = x.new_zeros((n, th * m + 2, tw * m + 2, c), dtype=work)
    xp[:, padding[0] : padding[0] + h, padding[1] : padding[1] + w] = x.permute(0, 2, 3, 1)
    d = xp.unfold(1, a, m).unfold(2, a, m)  # [N, th, tw, C, a_j, a_k], a view
    d = d.permute(4, 5, 0, 1, 2, 3).reshape(a * a, -1)  # the gather copy
    v = _kron(_RAW[m][0], work, x.device) @ d  # [a_i * a_l, N * th * tw * C]
    if groups == 1:
        return v.reshape(a * a, n * th * tw, c)
    v = v.reshape(a * a, n * th * tw, groups, c // groups).transpose(1, 2)
    return v.reshape(a * a * groups, n * th * tw, c // groups)


def output_transform_gemm(
    prod: torch.Tensor,
    shape: tuple[int, int, int, int],
    m: int,
    groups: int,
    fmt: torch.memory_format,
) -> torch.Tensor:
    """output_transform by one GEMM (same arguments and result)."""
    n, o, ho, wo = shape
    a = m + 2
    th, tw = -(-ho // m), -(-wo // m)
    if groups > 1:
        prod = prod.reshape(a * a, groups, n * th * tw, o // groups).transpose(1, 2)
    y = _kron(_RAW[m][2], prod.dtype, prod.device) @ prod.reshape(a * a, -1)
    y = y.reshape(m, m, n, th, tw, o).permute(2, 3, 0, 4, 1, 5)  # [N, th, m_r, tw, m_s, O]
    y = y.reshape(n, th * m, tw * m, o)[:, :ho, :wo].permute(0, 3, 1, 2)
    return y if fmt == torch.channels_last else y.contiguous()


# ----------------------------------------------------------------------------- Triton


# The products, one program per (point of the transform, block of tiles, block of output
# channels): [BLOCK_T x C] @ [C x BLOCK_O] by tl.dot, C in steps of BLOCK_C. A point's GEMM
# is 2 * tiles * C * O flops over (tiles * C + C * O) * 2 bytes of half inputs: for
# ResNet's 3x3 layers (C = O = 64..512) 32..256 flops a byte, on the tensor cores' side of
# an H100's ridge, so the products run as GEMMs do; Winograd's gain is a^2 / (9 m^2) of
# the direct conv's flops, paid for by the transforms' memory passes.
def _products_fn(
    v_ptr: Any,  # [P, T, Cg] (P = points x groups), contiguous
    u_ptr: Any,  # [P, Cg, Og], contiguous
    out_ptr: Any,  # [P, T, Og] float32, contiguous
    T: Any,
    C: Any,
    OUT: Any,  # Og
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
    v = (input_transform_gemm if triton else input_transform)(x, padding, m, groups)
    if triton:
        # the tensor cores take V and U in the input's dtype (this rounding is where
        # F(4,3) in half precision loses digits); products and transform back in float32
        prod = triton_products(v.to(x.dtype), u.to(x.dtype))
    else:
        prod = torch.bmm(v, u)
    y = (output_transform_gemm if triton else output_transform)(
        prod, (n, o, ho, wo), m, groups, fmt
    )
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
