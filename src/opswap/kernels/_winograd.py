"""The arithmetic of Winograd F(2x2,3x3) and F(4x4,3x3) (kernels/conv_winograd.py says
what it is for): the transform matrices, written out, and the input, filter and output
transforms, as additions (the CPU) or as two GEMMs (CUDA), laid out for the products."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch

from opswap.errors import OpswapError

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
    o, cg = weight.shape[0], weight.shape[1]
    a = m + 2
    # one GEMM by G kron G ([a*a, 9]): done once per weight (cached), and a few nodes
    # where the op is traced
    u = _kron(_RAW[m][1], work, weight.device) @ weight.to(work).reshape(o * cg, 9).T
    u = u.reshape(a * a, groups, o // groups, cg).transpose(2, 3)  # [a*a, g, Cg, Og]
    return u.reshape(a * a * groups, cg, o // groups).contiguous()


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
    return _by_group(v, a * a, n * th * tw, c, groups)


def _by_group(v: torch.Tensor, points: int, tiles: int, c: int, groups: int) -> torch.Tensor:
    """V [points, tiles, C] as [points * groups, tiles, C / groups]: one GEMM batch per
    (point, group)."""
    if groups == 1:
        return v.reshape(points, tiles, c)
    v = v.reshape(points, tiles, groups, c // groups).transpose(1, 2)
    return v.reshape(points * groups, tiles, c // groups)


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
    return _by_group(v, a * a, n * th * tw, c, groups)


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
