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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError

Pair = tuple[int, int]
METHODS = ("channel", "spatial", "cp", "depthwise", "stacked")


@dataclass(frozen=True)
class Layer:
    """One conv of a chain (or the original): weight [out, in/groups, kh, kw]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    groups: int = 1

    @property
    def out_channels(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_channels(self) -> int:
        return int(self.weight.shape[1]) * self.groups

    @property
    def kernel_size(self) -> Pair:
        return int(self.weight.shape[2]), int(self.weight.shape[3])

    def out_size(self, h: int, w: int) -> Pair:
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        (ph, pw), (dh, dw) = self.padding, self.dilation
        return (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (
            w + 2 * pw - dw * (kw - 1) - 1
        ) // sw + 1

    def macs(self, h: int, w: int) -> int:
        """Multiply-adds on an [*, in, h, w] input."""
        oh, ow = self.out_size(h, w)
        return int(self.weight[0].numel()) * self.out_channels * max(oh, 0) * max(ow, 0)

    def params(self) -> int:
        return int(self.weight.numel()) + (0 if self.bias is None else int(self.bias.numel()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def module(self, dtype: torch.dtype, device: torch.device | None = None) -> nn.Conv2d:
        conv = nn.Conv2d(
            self.in_channels,
            self.out_channels,
            self.kernel_size,  # type: ignore[arg-type]
            stride=self.stride,  # type: ignore[arg-type]
            padding=self.padding,  # type: ignore[arg-type]
            dilation=self.dilation,  # type: ignore[arg-type]
            groups=self.groups,
            bias=self.bias is not None,
            device=device,
            dtype=dtype,
        )
        with torch.no_grad():
            conv.weight.copy_(self.weight)
            if self.bias is not None and conv.bias is not None:
                conv.bias.copy_(self.bias)
        return conv


@dataclass(frozen=True)
class Decomposition:
    """A chain of convs standing for one conv, and how far it is from it."""

    method: str
    rank: int
    layers: tuple[Layer, ...]
    weight_error: float

    def kernel(self) -> torch.Tensor:
        """The dense kernel [O, C, kh, kw] the chain computes (dilation aside)."""
        return composed(self.layers)

    def macs(self, h: int, w: int) -> int:
        total = 0
        for layer in self.layers:
            total += layer.macs(h, w)
            h, w = layer.out_size(h, w)
        return total

    def params(self) -> int:
        return sum(layer.params() for layer in self.layers)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def module(self, dtype: torch.dtype, device: torch.device | None = None) -> nn.Sequential:
        return nn.Sequential(*(layer.module(dtype, device) for layer in self.layers))

    def describe(self) -> str:
        shapes = " -> ".join(
            f"{layer.kernel_size[0]}x{layer.kernel_size[1]}"
            f"{' dw' if layer.groups > 1 and layer.groups == layer.in_channels else ''}"
            f" [{layer.out_channels}]"
            for layer in self.layers
        )
        what = "width" if self.method == "stacked" else "rank"
        return f"{self.method} {what} {self.rank}: {shapes}"


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


# --------------------------------------------------------------------------- composing kernels


def dense(layer: Layer) -> torch.Tensor:
    """The layer's weight as an ungrouped [O, C, kh, kw] kernel (zeros across groups)."""
    w, g = layer.weight, layer.groups
    if g == 1:
        return w
    o, cg = w.shape[0] // g, w.shape[1]
    out = w.new_zeros(w.shape[0], cg * g, *w.shape[2:])
    for i in range(g):
        out[i * o : (i + 1) * o, i * cg : (i + 1) * cg] = w[i * o : (i + 1) * o]
    return out


def compose(first: torch.Tensor, then: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The kernel of `then` applied after `first` (stride 1, no padding between them), both
    with `groups`: K[o, c] = sum_m then[o, m] * first[m, c], `*` a full 2-D convolution
    of the taps (cross-correlation of cross-correlations adds the offsets)."""
    # batch = first's input channels, channels = its outputs: one conv sums over m
    kh, kw = then.shape[2:]
    out = F.conv2d(
        first.transpose(0, 1), then.flip(-1, -2), padding=(kh - 1, kw - 1), groups=groups
    )
    return out.transpose(0, 1)


def composed(layers: Sequence[Layer]) -> torch.Tensor:
    """The dense kernel a chain computes (as if its stride and dilation were 1)."""
    same = all(layer.groups == layers[0].groups for layer in layers)
    k = layers[0].weight if same else dense(layers[0])
    for layer in layers[1:]:
        k = compose(k, layer.weight, layer.groups) if same else compose(k, dense(layer))
    return k


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def output_error(original: Layer, dec: Decomposition, x: torch.Tensor) -> float:
    """Relative L2 of the chain's output against the original conv's on the inputs `x`."""
    x = x.detach().double().cpu()
    return _rel(dec(x), original(x))


# --------------------------------------------------------------------------- the methods


def _refuse_grouped(conv: Layer, what: str) -> None:
    if conv.groups != 1:
        raise RuleError(f"the conv has groups={conv.groups}; {what} takes ungrouped convs only.")


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
    _refuse_grouped(conv, "a channel low-rank split")
    o, c, kh, kw = conv.weight.shape
    left, right, _ = _svd_split(conv.weight.reshape(o, c * kh * kw), rank)
    r = left.shape[1]
    first = replace(conv, weight=right.reshape(r, c, kh, kw), bias=None)
    second = Layer(left.reshape(o, r, 1, 1), conv.bias)
    return Decomposition(
        "channel", r, (first, second), _rel(composed((first, second)), conv.weight)
    )


def _spatial_matrix(w: torch.Tensor) -> torch.Tensor:
    o, c, kh, kw = w.shape
    return w.permute(1, 2, 0, 3).reshape(c * kh, o * kw)  # [(c, y), (o, x)]


def spatial_rank(conv: Layer, max_error: float) -> int:
    return _energy_rank(torch.linalg.svdvals(_spatial_matrix(conv.weight)), max_error)


def spatial_svd(conv: Layer, rank: int) -> Decomposition:
    _refuse_grouped(conv, "a spatial low-rank split")
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
    return Decomposition("spatial", r, layers, _rel(composed(layers), conv.weight))


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
    _refuse_grouped(conv, "a CP decomposition")
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
    return Decomposition("cp", rank, layers, _rel(composed(layers), conv.weight))


def depthwise_separable(conv: Layer, multiplier: int = 1) -> Decomposition:
    _refuse_grouped(conv, "a depthwise-separable split")
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
    return Decomposition("depthwise", m, layers, _rel(composed(layers), conv.weight))


def stacked_count(conv: Layer) -> int | str:
    """How many 3x3 convs stand for the conv's k x k kernel, or why none do."""
    kh, kw = conv.kernel_size
    if kh != kw or kh < 5 or kh % 2 == 0:
        return (
            f"its kernel is {kh}x{kw}; stacking 3x3 convs stands for a square odd k x k with k >= 5"
        )
    return (kh - 1) // 2


def stack_layers(conv: Layer, weights: Sequence[torch.Tensor]) -> tuple[Layer, ...]:
    """The chain: all the padding on the first conv and the stride on the last, so that
    each later conv reads only values the original's window covers (no zeros between)."""
    n = len(weights)
    return tuple(
        Layer(
            w,
            conv.bias if i == n - 1 else None,
            conv.stride if i == n - 1 else (1, 1),
            conv.padding if i == 0 else (0, 0),
            conv.dilation,
            conv.groups,
        )
        for i, w in enumerate(weights)
    )


def _placed(w: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[a, b, size, kh, kw] -> [a, b, kh*kw, *size]: w placed at each offset of a window of
    `size` (zeros elsewhere), the columns of a composition's design matrix."""
    a, b, kh, kw = w.shape
    sh, sw = size[0] - kh + 1, size[1] - kw + 1
    out = w.new_zeros(a, b, sh * sw, *size)
    for i in range(sh):
        for j in range(sw):
            out[:, :, i * sw + j, i : i + kh, j : j + kw] = w
    return out


def _lstsq(design: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Least squares with a small ridge (the normal equations, solved once per design)."""
    gram = design.T @ design
    ridge = 1e-9 * gram.diagonal().mean().clamp_min(1e-300)
    return torch.linalg.solve(
        gram + ridge * torch.eye(len(gram), dtype=gram.dtype), design.T @ target
    )


def _als_pair(
    k: torch.Tensor, mid: int, ka: int, iters: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """k [O, C, K, K] ~ compose(A [mid, C, ka, ka], B [O, mid, K-ka+1, ...]) by alternating
    least squares: with one factor fixed the composition is linear in the other, and one
    design matrix serves every output (input) channel."""
    o, c, kk, _ = k.shape
    kb = kk - ka + 1
    a = torch.randn(mid, c, ka, ka, generator=gen, dtype=k.dtype)
    b = torch.zeros(o, mid, kb, kb, dtype=k.dtype)
    for _ in range(iters):
        # K[o, (c, w)] = sum_{m, v} B[o, m, v] A[m, c, w - v]: the design's columns are A
        # placed at each offset v of B's window
        design = _placed(a, (kk, kk)).permute(1, 3, 4, 0, 2).reshape(c * kk * kk, mid * kb * kb)
        b = _lstsq(design, k.permute(1, 2, 3, 0).reshape(c * kk * kk, o)).T.reshape(o, mid, kb, kb)
        # K[(o, w), c] = sum_{m, u} A[m, c, u] B[o, m, w - u]
        design = _placed(b, (kk, kk)).permute(0, 3, 4, 1, 2).reshape(o * kk * kk, mid * ka * ka)
        a = _lstsq(design, k.permute(0, 2, 3, 1).reshape(o * kk * kk, c)).T.reshape(c, mid, ka, ka)
        a = a.transpose(0, 1).contiguous()
    return a, b


def stacked_3x3(
    conv: Layer,
    mid: int | None = None,
    *,
    iters: int = 30,
    inputs: torch.Tensor | None = None,
    data_steps: int = 50,
    seed: int = 0,
) -> Decomposition:
    """(k-1)/2 stacked 3x3 convs (mid channels `mid`, default max(C, O) rounded up to the
    groups) fitted to the k x k conv: alternating least squares on the kernel they compose
    to (one 3x3 peeled off at a time: k x k ~ 3x3 then (k-2) x (k-2), and so on), then,
    given `inputs` (a batch of the conv's inputs), Adam on their outputs against the conv's,
    kept only where it lowers the output error on those inputs."""
    n = stacked_count(conv)
    if isinstance(n, str):
        raise RuleError(f"the conv cannot become stacked 3x3 convs: {n}.")
    o, cg = conv.weight.shape[:2]
    g = conv.groups
    mid = max(cg * g, o) if mid is None else mid
    mid = -(-mid // g) * g
    gen = torch.Generator().manual_seed(seed)
    per_group: list[list[torch.Tensor]] = []
    og, mg = o // g, mid // g
    for i in range(g):
        rest = conv.weight[i * og : (i + 1) * og]
        ws: list[torch.Tensor] = []
        for _ in range(n - 1):
            a, rest = _als_pair(rest, mg, 3, iters, gen)
            ws.append(a)
        ws.append(rest)
        per_group.append(ws)
    weights = [torch.cat([ws[j] for ws in per_group]) for j in range(n)]
    layers = stack_layers(conv, weights)
    if inputs is not None and data_steps > 0:
        layers = _refine(conv, layers, inputs.detach().double().cpu(), data_steps)
    return Decomposition("stacked", mid, layers, _rel(composed(layers), conv.weight))


def _refine(
    conv: Layer, layers: tuple[Layer, ...], x: torch.Tensor, steps: int
) -> tuple[Layer, ...]:
    """Adam on the stack's outputs against the conv's on `x`; the start is kept unless the
    result errs less there."""
    no_bias = replace(conv, bias=None)
    with torch.no_grad():
        want = no_bias(x)
    energy = (want**2).sum().clamp_min(1e-30)
    params = [layer.weight.clone().requires_grad_(True) for layer in layers]

    def data_loss() -> torch.Tensor:
        got = x
        for layer in stack_layers(no_bias, params):
            got = layer(got)
        return ((got - want) ** 2).sum() / energy

    with torch.no_grad():
        before = float(data_loss())
    _adam(params, data_loss, steps, 1e-3)
    with torch.no_grad():
        after = float(data_loss())
    return stack_layers(conv, [p.detach() for p in params]) if after < before else layers


def _adam(
    params: list[torch.Tensor], loss: Callable[[], torch.Tensor], steps: int, lr: float
) -> None:
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    for _ in range(steps):
        opt.zero_grad()
        value = loss()
        value.backward()
        opt.step()
        sched.step()


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
