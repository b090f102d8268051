"""A k x k conv as (k-1)/2 stacked 3x3 convs: the chain's layout (padding on the first, stride
on the last), and its fit, alternating least squares on the composed kernel and then
Adam on sample outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from opswap.errors import RuleError
from opswap.rules.conv._chain import Decomposition, Layer, composed, rel_l2


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
    return Decomposition("stacked", mid, layers, rel_l2(composed(layers), conv.weight))


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
