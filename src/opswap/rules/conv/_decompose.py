"""Lossy decompositions of a dense 2-D convolution into a chain of cheaper ones, fitted
from its trained weight: shared by the rules conv.low_rank, conv.cp,
conv.depthwise_separable and conv.stacked_3x3 and by opswap.train.distill_conv.

W is the kernel [O, C, kh, kw]; every method returns a `Decomposition`, a chain of
`Layer`s whose composition approximates W, built so that the chain is *structurally*
the original conv whenever the fit is exact: padding goes to the layer that first
reaches each axis (per axis for the separable splits), stride to the layer where
subsampling commutes with what follows, the bias to the last layer. So the only error
is the fit's, and at full rank the chain reproduces the conv to rounding.

- `channel_svd` (rank r): [r, C, kh, kw] then 1x1 [O, r]; the SVD of W as [O, C*kh*kw]
  (Zhang et al., "Accelerating very deep convolutional networks", 2015).
- `spatial_svd` (rank r): vertical [r, C, kh, 1] then horizontal [O, r, 1, kw]; the
  SVD of W as [C*kh, O*kw] (Jaderberg et al., 2014, scheme 2).
- `cp` (rank R): 1x1 [R, C], depthwise kh x 1, depthwise 1 x kw, 1x1 [O, R]; a
  rank-R CP decomposition of W by alternating least squares (Lebedev et al., 2015).
  Written here rather than taken from tensorly: a 4-way CP-ALS is forty lines of torch,
  and tensorly would be a dependency for one function.
- `depthwise_separable` (multiplier m): depthwise kh x kw [C*m, 1] then 1x1 [O, C*m];
  per input channel c, the best rank-m approximation of W[:, c] as [O, kh*kw], which is
  the least-squares fit of W[:, c] ~ sum_j p[:, j] (x) d_j.
- `stacked_3x3` (k = 5, 7, 9, ...): (k-1)/2 convs 3x3 with no activation between them
  (so that the chain stays a linear map, which a ReLU would stop it being), fitted to W
  by alternating least squares in weight space (the composition is linear in each conv
  with the other fixed) and then, given sample inputs, by Adam on the conv's outputs.

Errors: `weight_error` is the relative L2 of the composed kernel against W; the output
error on sample inputs (`output_error`) is what a user sees. For white-noise inputs the
two agree (the output's squared error is the kernel's, summed over positions), so the
weight fit is the distillation on random inputs, done without drawing any.

The chain itself (Layer, Decomposition, composing kernels) is in _chain.py, CP-ALS in
_cp.py and the stacked 3x3 fit in _stack.py; this module re-exports them beside the SVD
splits, the depthwise-separable fit and the choice of rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from opswap.errors import RuleError
from opswap.rules.conv._chain import (
    Decomposition,
    Layer,
    Pair,
    compose,
    composed,
    dense,
    refuse_grouped,
    rel_l2,
)
from opswap.rules.conv._cp import cp, cp_als, cp_tensor
from opswap.rules.conv._stack import stack_layers, stacked_3x3, stacked_count

METHODS = ("channel", "spatial", "cp", "depthwise", "stacked")
__all__ = [
    "METHODS",
    "Decomposition",
    "Layer",
    "channel_rank",
    "channel_svd",
    "compose",
    "composed",
    "cp",
    "cp_als",
    "cp_tensor",
    "dense",
    "depthwise_separable",
    "fit",
    "layer_of",
    "max_rank",
    "output_error",
    "smallest",
    "spatial_rank",
    "spatial_svd",
    "stack_layers",
    "stacked_3x3",
    "stacked_count",
]

# --------------------------------------------------------------------------- reading a conv


def _pair(v: int | Sequence[int], what: str) -> Pair:
    t = (v, v) if isinstance(v, int) else tuple(int(x) for x in v)
    if len(t) != 2:
        raise RuleError(f"{what} {v!r} is not a pair of ints for a 2-D convolution.")
    return t[0], t[1]


def layer_of(conv: nn.Module) -> Layer:
    """The Layer of an nn.Conv2d (float64 copies of its tensors), or RuleError saying why
    it cannot be decomposed."""
    if not isinstance(conv, nn.Conv2d):
        raise RuleError(
            f"{type(conv).__name__} is not an nn.Conv2d; only 2-D convolutions decompose."
        )
    if conv.padding_mode != "zeros":
        raise RuleError(
            f"the conv pads with padding_mode={conv.padding_mode!r}; the decompositions pad with zeros only."
        )
    padding = conv.padding
    if isinstance(padding, str):
        kh, kw = conv.kernel_size
        dh, dw = conv.dilation
        if padding == "valid":
            padding = (0, 0)
        elif (dh * (kh - 1)) % 2 or (dw * (kw - 1)) % 2:
            raise RuleError(
                "the conv uses padding='same' with an even kernel, which pads unevenly."
            )
        else:
            padding = (dh * (kh - 1) // 2, dw * (kw - 1) // 2)
    return Layer(
        conv.weight.detach().double().cpu(),
        None if conv.bias is None else conv.bias.detach().double().cpu(),
        _pair(conv.stride, "stride"),
        _pair(padding, "padding"),  # type: ignore[arg-type]
        _pair(conv.dilation, "dilation"),
        int(conv.groups),
    )


def output_error(original: Layer, dec: Decomposition, x: torch.Tensor) -> float:
    """Relative L2 of the chain's output against the original conv's on the inputs `x`."""
    x = x.detach().double().cpu()
    return rel_l2(dec(x), original(x))


# --------------------------------------------------------------------------- the methods


def _energy_rank(s: torch.Tensor, max_error: float) -> int:
    """The smallest rank whose truncation leaves relative L2 error <= max_error."""
    tail = (s.flip(0) ** 2).cumsum(0).flip(0)  # tail[i] = sum_{j >= i} s_j^2
    rel = torch.sqrt(tail / tail[0].clamp_min(1e-300))
    ok = (rel[1:] <= max_error).nonzero()
    return int(ok[0]) + 1 if len(ok) else int(s.numel())


def _svd_split(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    r = min(rank, int(s.numel()))
    root = s[:r].sqrt()
    err = float(s[r:].norm() / s.norm().clamp_min(1e-300))
    return u[:, :r] * root, root[:, None] * vh[:r], err


def channel_rank(conv: Layer, max_error: float) -> int:
    o, c, kh, kw = conv.weight.shape
    return _energy_rank(torch.linalg.svdvals(conv.weight.reshape(o, -1)), max_error)


def channel_svd(conv: Layer, rank: int) -> Decomposition:
    refuse_grouped(conv, "a channel low-rank split")
    o, c, kh, kw = conv.weight.shape
    left, right, _ = _svd_split(conv.weight.reshape(o, c * kh * kw), rank)
    r = left.shape[1]
    first = replace(conv, weight=right.reshape(r, c, kh, kw), bias=None)
    second = Layer(left.reshape(o, r, 1, 1), conv.bias)
    return Decomposition(
        "channel", r, (first, second), rel_l2(composed((first, second)), conv.weight)
    )


def _spatial_matrix(w: torch.Tensor) -> torch.Tensor:
    o, c, kh, kw = w.shape
    return w.permute(1, 2, 0, 3).reshape(c * kh, o * kw)  # [(c, y), (o, x)]


def spatial_rank(conv: Layer, max_error: float) -> int:
    return _energy_rank(torch.linalg.svdvals(_spatial_matrix(conv.weight)), max_error)


def spatial_svd(conv: Layer, rank: int) -> Decomposition:
    refuse_grouped(conv, "a spatial low-rank split")
    o, c, kh, kw = conv.weight.shape
    left, right, _ = _svd_split(_spatial_matrix(conv.weight), rank)
    r = left.shape[1]
    (sh, sw), (ph, pw), (dh, dw) = conv.stride, conv.padding, conv.dilation
    vertical = Layer(
        left.reshape(c, kh, r).permute(2, 0, 1)[..., None], None, (sh, 1), (ph, 0), (dh, 1)
    )
    horizontal = Layer(
        right.reshape(r, o, kw).permute(1, 0, 2)[:, :, None], conv.bias, (1, sw), (0, pw), (1, dw)
    )
    layers = (vertical, horizontal)
    return Decomposition("spatial", r, layers, rel_l2(composed(layers), conv.weight))


def depthwise_separable(conv: Layer, multiplier: int = 1) -> Decomposition:
    refuse_grouped(conv, "a depthwise-separable split")
    o, c, kh, kw = conv.weight.shape
    m = min(multiplier, o, kh * kw)
    # per input channel c: W[:, c] as [O, kh*kw] = P_c @ D_c, P_c [O, m], D_c [m, kh*kw]
    u, s, vh = torch.linalg.svd(
        conv.weight.permute(1, 0, 2, 3).reshape(c, o, kh * kw), full_matrices=False
    )
    root = s[:, :m].sqrt()
    p = u[:, :, :m] * root[:, None, :]  # [C, O, m]
    d = root[:, :, None] * vh[:, :m]  # [C, m, kh*kw]
    dw = Layer(d.reshape(c * m, 1, kh, kw), None, conv.stride, conv.padding, conv.dilation, c)
    pw = Layer(p.permute(1, 0, 2).reshape(o, c * m, 1, 1), conv.bias)
    layers = (dw, pw)
    return Decomposition("depthwise", m, layers, rel_l2(composed(layers), conv.weight))


# --------------------------------------------------------------------------- choosing a rank


def fit(
    conv: Layer, method: str, rank: int, inputs: torch.Tensor | None = None, *, quick: bool = False
) -> Decomposition:
    """The `method` decomposition at `rank` (the multiplier for "depthwise", the mid
    channels for "stacked")."""
    if method not in METHODS:
        raise RuleError(f"method must be one of {', '.join(METHODS)}; got {method!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise RuleError(f"rank must be a positive integer; got {rank!r}.")
    if method == "channel":
        return channel_svd(conv, rank)
    if method == "spatial":
        return spatial_svd(conv, rank)
    if method == "cp":
        return cp(conv, rank, 15 if quick else 50)
    if method == "depthwise":
        return depthwise_separable(conv, rank)
    return stacked_3x3(conv, rank, inputs=inputs)


def smallest(conv: Layer, method: str, max_error: float, limit: int) -> Decomposition | None:
    """The lowest-rank decomposition (rank <= `limit`) with weight error <= `max_error`,
    or None. SVD ranks come from the singular values; CP and depthwise by bisection
    (their error falls with the rank, up to the fit's noise)."""
    if limit < 1:
        return None
    if method in ("channel", "spatial"):
        rank = (channel_rank if method == "channel" else spatial_rank)(conv, max_error)
        return fit(conv, method, rank) if rank <= limit else None
    # the search fits CP with few ALS sweeps; the rank it settles on is fitted in full
    best = fit(conv, method, limit)
    if best.weight_error > max_error:
        return None
    lo, hi = 1, limit  # hi meets the bound
    while lo < hi:
        midr = (lo + hi) // 2
        if fit(conv, method, midr, quick=True).weight_error <= max_error:
            hi = midr
        else:
            lo = midr + 1
    if hi == limit:
        return best
    d = fit(conv, method, hi)
    return d if d.weight_error <= max_error else best


def max_rank(conv: Layer, method: str, h: int, w: int, keep: float) -> int:
    """The largest rank whose chain costs at most `keep` of the conv's multiply-adds at an
    h x w input (0 when even rank 1 costs more)."""
    budget = keep * conv.macs(h, w)
    o, cg, kh, kw = conv.weight.shape
    c = cg * conv.groups
    probe = {
        "channel": lambda r: _cost_channel(conv, r, h, w),
        "spatial": lambda r: _cost_spatial(conv, r, h, w),
        "cp": lambda r: _cost_cp(conv, r, h, w),
        "depthwise": lambda r: _cost_dw(conv, r, h, w),
    }[method]
    top = {
        "channel": min(o, c * kh * kw),
        "spatial": min(c * kh, o * kw),
        "cp": o * c * kh * kw,
        "depthwise": min(o, kh * kw),
    }[method]
    best = 0
    lo, hi = 1, top
    while lo <= hi:  # the cost grows with the rank
        r = (lo + hi) // 2
        if probe(r) <= budget:
            best, lo = r, r + 1
        else:
            hi = r - 1
    return best


def _chain_macs(layers: Sequence[Layer], h: int, w: int) -> int:
    total = 0
    for layer in layers:
        total += layer.macs(h, w)
        h, w = layer.out_size(h, w)
    return total


def _shape_only(
    conv: Layer, shapes: Sequence[tuple[tuple[int, ...], Pair, Pair, Pair, int]]
) -> list[Layer]:
    return [Layer(torch.empty(s, device="meta"), None, st, p, d, g) for s, st, p, d, g in shapes]


def _cost_channel(conv: Layer, r: int, h: int, w: int) -> int:
    o, c, kh, kw = conv.weight.shape
    one = (1, 1)
    return _chain_macs(
        _shape_only(
            conv,
            [
                ((r, c, kh, kw), conv.stride, conv.padding, conv.dilation, 1),
                ((o, r, 1, 1), one, (0, 0), one, 1),
            ],
        ),
        h,
        w,
    )


def _cost_spatial(conv: Layer, r: int, h: int, w: int) -> int:
    o, c, kh, kw = conv.weight.shape
    (sh, sw), (ph, pw), (dh, dw) = conv.stride, conv.padding, conv.dilation
    return _chain_macs(
        _shape_only(
            conv,
            [
                ((r, c, kh, 1), (sh, 1), (ph, 0), (dh, 1), 1),
                ((o, r, 1, kw), (1, sw), (0, pw), (1, dw), 1),
            ],
        ),
        h,
        w,
    )


def _cost_cp(conv: Layer, r: int, h: int, w: int) -> int:
    o, c, kh, kw = conv.weight.shape
    (sh, sw), (ph, pw), (dh, dw) = conv.stride, conv.padding, conv.dilation
    one, zero = (1, 1), (0, 0)
    return _chain_macs(
        _shape_only(
            conv,
            [
                ((r, c, 1, 1), one, zero, one, 1),
                ((r, 1, kh, 1), (sh, 1), (ph, 0), (dh, 1), r),
                ((r, 1, 1, kw), (1, sw), (0, pw), (1, dw), r),
                ((o, r, 1, 1), one, zero, one, 1),
            ],
        ),
        h,
        w,
    )


def _cost_dw(conv: Layer, m: int, h: int, w: int) -> int:
    o, c, kh, kw = conv.weight.shape
    one = (1, 1)
    return _chain_macs(
        _shape_only(
            conv,
            [
                ((c * m, 1, kh, kw), conv.stride, conv.padding, conv.dilation, c),
                ((o, c * m, 1, 1), one, (0, 0), one, 1),
            ],
        ),
        h,
        w,
    )
