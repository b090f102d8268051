"""CP decomposition of a conv kernel by alternating least squares (Lebedev et al. 2015):
W[o, c, y, x] ~ sum_r A[o, r] B[c, r] Y[y, r] X[x, r] as 1x1, depthwise kh x 1,
depthwise 1 x kw, 1x1. Written here rather than taken from tensorly: a 4-way CP-ALS is a
few dozen lines of torch, and tensorly would be a dependency for one function."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opswap.rules.conv._chain import Decomposition, Layer, composed, refuse_grouped, rel_l2


def _mttkrp(t: torch.Tensor, factors: Sequence[torch.Tensor], mode: int) -> torch.Tensor:
    """The tensor unfolded along `mode` times the Khatri-Rao product of the other factors,
    [n_mode, rank], contracted largest mode first: the product itself would hold
    n_other^3 x rank numbers (880 MB for a 256-channel 3x3 kernel at rank 560)."""
    letters = "abcd"
    others = sorted((m for m in range(4) if m != mode), key=lambda m: -t.shape[m])
    first, rest = others[0], others[1:]
    kept = "".join(letters[m] for m in range(4) if m != first)
    x = torch.einsum(f"{letters},{letters[first]}r->{kept}r", t, factors[first])
    spec = f"{kept}r," + ",".join(f"{letters[m]}r" for m in rest) + f"->{letters[mode]}r"
    return torch.einsum(spec, x, *(factors[m] for m in rest))


def cp_als(
    t: torch.Tensor, rank: int, iters: int = 60, seed: int = 0
) -> tuple[list[torch.Tensor], float]:
    """Rank-`rank` CP factors [n_i, rank] of the 4-way tensor `t` (float64) by alternating
    least squares, with the relative L2 error of their reconstruction. Starts from the
    leading left singular vectors of each unfolding (padded with seeded noise where a mode
    is shorter than the rank), so the result is deterministic."""
    gen = torch.Generator().manual_seed(seed)
    factors = []
    for mode in range(4):
        unfold = t.movedim(mode, 0).reshape(t.shape[mode], -1)
        u = torch.linalg.svd(unfold, full_matrices=False)[0]
        extra = rank - u.shape[1]
        if extra > 0:
            u = torch.cat([u, torch.randn(u.shape[0], extra, generator=gen, dtype=t.dtype)], 1)
        factors.append(u[:, :rank].clone())
    norm = t.norm().clamp_min(1e-300)
    err = 1.0
    for it in range(iters):
        for mode in range(4):
            others = [factors[m] for m in range(4) if m != mode]
            gram = torch.ones(rank, rank, dtype=t.dtype)
            for f in others:
                gram = gram * (f.T @ f)
            mttkrp = _mttkrp(t, factors, mode)
            # a small ridge keeps the normal equations solvable where factors are collinear
            ridge = 1e-12 * gram.diagonal().sum().clamp_min(1e-300)
            gram = gram + ridge * torch.eye(rank, dtype=t.dtype)
            factors[mode] = torch.linalg.solve(gram, mttkrp.T).T
        if (it + 1) % 5 and it + 1 < iters:
            continue
        new = float((cp_tensor(factors) - t).norm() / norm)
        if abs(err - new) < 1e-6:
            err = new
            break
        err = new
    return factors, err


def cp_tensor(factors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.einsum("ar,br,cr,dr->abcd", *factors)


def cp(conv: Layer, rank: int, iters: int = 50) -> Decomposition:
    refuse_grouped(conv, "a CP decomposition")
    o, c, kh, kw = conv.weight.shape
    # any 4-way tensor has CP rank <= the smallest product of three of its sizes (an
    # unfolding's); a larger rank only makes the least squares singular
    rank = min(rank, o * c * kh, o * c * kw, o * kh * kw, c * kh * kw)
    (a, b, y, x), _ = cp_als(conv.weight, rank, iters)
    (sh, sw), (ph, pw), (dh, dw) = conv.stride, conv.padding, conv.dilation
    layers = (
        Layer(b.T.reshape(rank, c, 1, 1).contiguous()),
        Layer(y.T.reshape(rank, 1, kh, 1).contiguous(), None, (sh, 1), (ph, 0), (dh, 1), rank),
        Layer(x.T.reshape(rank, 1, 1, kw).contiguous(), None, (1, sw), (0, pw), (1, dw), rank),
        Layer(a.reshape(o, rank, 1, 1).contiguous(), conv.bias),
    )
    return Decomposition("cp", rank, layers, rel_l2(composed(layers), conv.weight))
