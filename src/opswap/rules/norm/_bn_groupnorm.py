"""What a GroupNorm that replaces an eval BatchNorm starts from: its group count and its
affine weight and bias. Shared by the rule norm.batchnorm_groupnorm and the model-level
opswap.train.norm_swap.prepare.

An eval BatchNorm is a per-channel affine map of its input, y = s[c] * x + t[c] with
s = gamma / sqrt(running_var + eps) and t = beta - running_mean * s. A GroupNorm computes
z = (x - mean_g) / sqrt(var_g + eps) from the sample's own group (C/G channels and every
position) and then y' = a[c] * z + b[c]. Three starting points for (a, b):

- `affine`: the BatchNorm's gamma and beta. Right only if every group's per-sample mean
  and variance were the channel's running ones, which they are not: a group mixes
  channels with different means and scales.
- `stats`: from the running statistics alone. Treat a group's mean and variance as the
  mixture of its channels' (M = mean of the channels' means, V = mean of their variances
  plus the spread of their means around M); then x = M + sqrt(V + eps) * z, and
  y = s * x + t gives a = s * sqrt(V + eps), b = s * M + t. It ignores how much a group's
  statistics move from sample to sample (and along the positions): no data needed.
- `fit`: least squares on sample inputs: per channel, regress the BatchNorm's output on
  the GroupNorm-normalised input, a = cov(z, y) / var(z), b = mean(y) - a * mean(z).
  The sums are accumulated in float64, so any number of batches costs a few vectors.

Measured (tests/train/test_norm_swap.py checks the order of the first two; the chapter page,
docs/chapters/10-normalization.md, has the figures): on a digits conv net with two
BatchNorm2d and a BatchNorm1d, the logits' distance from the BatchNorm model's on the
held-out split is 0.41 from `affine`, 0.23 from `stats` and 0.31 from `fit` (8 groups;
0.45, 0.13 and 0.21 as LayerNorm). The fit is the best per layer on its own data, and
still worse end to end: least squares shrinks each slope by the correlation of z with y
(a = rho * std(y) / std(z)), so every layer hands the next a signal of smaller spread
than it was trained on, and the shrinkage compounds. `stats` is the default for that
reason, and needs no data; matching each channel's spread instead of least squares sat
in between (tried on the same net, not kept).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: the group count the rule aims for (GroupNorm's paper default), lowered to a divisor of C
GROUPS = 32


def group_count(channels: int, groups: int = GROUPS) -> int:
    """The largest divisor of `channels` that is at most `groups` (1 for LayerNorm)."""
    if channels < 1 or groups < 1:
        raise ValueError(f"channels ({channels}) and groups ({groups}) must be at least 1")
    return next(g for g in range(min(groups, channels), 0, -1) if channels % g == 0)


def scale_shift(
    mean: torch.Tensor | None,
    var: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    channels: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, t) in float64 with bn(x) = s * x + t per channel; without running statistics
    (a BatchNorm that always uses the batch's), the affine alone."""
    s = torch.ones(channels, dtype=torch.float64)
    t = torch.zeros(channels, dtype=torch.float64)
    if mean is not None and var is not None:
        s = torch.rsqrt(var.detach().double().cpu() + eps)
        t = -mean.detach().double().cpu() * s
    if weight is not None:
        w = weight.detach().double().cpu()
        s, t = s * w, t * w
    if bias is not None:
        t = t + bias.detach().double().cpu()
    return s, t


def affine_init(
    weight: torch.Tensor | None, bias: torch.Tensor | None, channels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The BatchNorm's gamma and beta (ones and zeros where it has none), float64."""
    a = torch.ones(channels, dtype=torch.float64) if weight is None else weight.detach()
    b = torch.zeros(channels, dtype=torch.float64) if bias is None else bias.detach()
    return a.double().cpu(), b.double().cpu()


def stats_init(
    mean: torch.Tensor,
    var: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor,
    groups: int,
    gn_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) from the running statistics: each group's statistics taken as the mixture
    of its channels' (see the module's docstring), float64."""
    m = mean.detach().double().cpu().reshape(groups, -1)
    v = var.detach().double().cpu().reshape(groups, -1)
    group_mean = m.mean(1, keepdim=True)
    group_var = (v + (m - group_mean) ** 2).mean(1, keepdim=True)
    a = s * torch.sqrt(group_var + gn_eps).expand_as(m).reshape(-1)
    b = s * group_mean.expand_as(m).reshape(-1) + t
    return a, b


class AffineFit:
    """Per-channel least squares of a BatchNorm's output y on the GroupNorm-normalised
    input z, over as many (x, y) batches as `add` is given; `solve` returns (a, b)."""

    def __init__(self, channels: int, groups: int, eps: float):
        self.groups, self.eps = groups, eps
        zeros = torch.zeros(channels, dtype=torch.float64)
        self.n = 0
        self.sz, self.szz, self.sy, self.szy = zeros, zeros.clone(), zeros.clone(), zeros.clone()

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x, y: [N, C, *spatial] (the BatchNorm's input and output)."""
        x, y = x.detach().double().cpu(), y.detach().double().cpu()
        z = F.group_norm(x, self.groups, eps=self.eps)
        dims = [d for d in range(x.dim()) if d != 1]
        self.n += x.numel() // x.shape[1]
        self.sz = self.sz + z.sum(dims)
        self.szz = self.szz + (z * z).sum(dims)
        self.sy = self.sy + y.sum(dims)
        self.szy = self.szy + (z * y).sum(dims)

    def solve(
        self, fallback: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) in float64; a channel whose z did not vary (a group of one value, a
        constant channel) keeps `fallback`'s values."""
        if self.n == 0:
            return fallback
        mz, my = self.sz / self.n, self.sy / self.n
        var_z = self.szz / self.n - mz * mz
        cov = self.szy / self.n - mz * my
        ok = var_z > 1e-12
        a = torch.where(ok, cov / var_z.clamp_min(1e-12), fallback[0])
        b = torch.where(ok, my - a * mz, fallback[1])
        return a, b
