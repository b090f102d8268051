"""GroupNorm (and InstanceNorm, its G = C case), forward and backward: the ops
`opswap::group_norm` and `opswap::group_norm_backward`.

    x: [N, C, *spatial], G groups of C/G channels; a group is x[n, g*C/G:(g+1)*C/G, ...],
    L = C/G * prod(spatial) elements, contiguous in a contiguous x.
    mean, var over each group; rstd = rsqrt(var + eps)
    y = ((x - mean) * rstd * w[c] + b[c]).to(x.dtype)      fp32 math inside

which is what `F.group_norm` computes (it, too, accumulates in fp32 for bf16/fp16).

One program per (sample, group). A group of up to 16 K values is held in registers: x is
read once, its mean and variance taken in two passes over the registers, and y written
(4 bytes an element in bf16). A larger group (32 channels of 64 x 64 are 131 K values),
or one whose size is symbolic while torch.export or a dynamic compile traces the launch,
is walked in chunks of BLOCK: the
first walk merges each chunk's mean and sum of squared deviations into the running ones
(Chan's pairwise update: no E[x^2] - E[x]^2 cancellation), the second writes y. That is
x read twice and y written once: 6 bytes an element in bf16 against ATen's CUDA kernels'
same two reads of x (its statistics kernel, then its apply kernel) and one write, so the
gain, if any, is one launch and the per-channel scale/shift tensor ATen builds between
them. Measured on the H200 (bf16, 32 groups of 4096 a sample; results/norm_kernels_h200.json):
2.79 TB/s of GPU time forward at 32768 groups, 3.7x ATen's and 1.64x torch.compile's; the
rule (norm.group_norm) keeps ATen's op wherever the crossover table has no entry
saying the kernel wins.

Backward, one program per (sample, group) as well, with xhat = (x - mean) * rstd and
dxhat = dy * w[c]: a walk recomputes mean and rstd; a walk per channel sums dy * xhat and
dy (the channel's partial dw and db for this sample, summed over samples by PyTorch, and
through w the group's sums of dxhat * xhat and dxhat); a last walk writes
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from opswap.kernels._layout import as_promised, channels_last_of, in_format
from opswap.kernels._rows import (
    compiles_to_reference,
    jitted,
    rn,
    rn_flag,
    runs_triton,
    tl,
    triton,
)
from opswap.kernels._triton_op import triton_op

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("group_norm",)

#: the most elements one program holds per chunk of a group (8 warps: 16 fp32 a thread)
MAX_BLOCK = 2048
#: the largest group the forward holds in registers at once (16 warps: 32 values a thread),
#: reading x once instead of twice
ONE_PASS_MAX = 16384
#: the most elements of one channel per chunk in the backward's per-channel walks
MAX_CHANNEL_BLOCK = 1024


def reference(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """The function in PyTorch (fp32 math for low-precision x, float64 for float64 x)."""
    xf = x.float() if x.dtype != torch.float64 else x
    n, c = x.shape[0], x.shape[1]
    g = xf.reshape(n, num_groups, -1)
    mean = g.mean(-1, keepdim=True)
    gc = g - mean
    y = (gc * torch.rsqrt(gc.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.to(y.dtype).reshape(per_channel)
    if bias is not None:
        y = y + bias.to(y.dtype).reshape(per_channel)
    return y.to(x.dtype)


if triton is not None:
    # named `group_stats` where it is defined: Inductor copies a helper under its def's name
    @triton.jit
    def group_stats(x_ptr, base, L, eps, offs, BLOCK: tl.constexpr):
        """(mean, rstd) of the L values at x_ptr + base, BLOCK at a time: each chunk's mean
        and sum of squared deviations merged into the running ones (Chan's update)."""
        count = 0.0
        mean = 0.0
        m2 = 0.0
        for start in range(0, L, BLOCK):
            idx = start + offs
            ok = idx < L
            v = tl.load(x_ptr + base + idx, mask=ok, other=0.0).to(tl.float32)
            k = tl.minimum(L - start, BLOCK).to(tl.float32)
            cmean = tl.sum(v, 0) / k
            d = tl.where(ok, v - cmean, 0.0)
            cm2 = tl.sum(d * d, 0)
            total = count + k
            delta = cmean - mean
            mean = mean + delta * (k / total)
            m2 = m2 + cm2 + delta * delta * (count * k / total)
            count = total
        return mean, tl.rsqrt(m2 / L + eps)


def _gn_fwd_fn(
    x_ptr,  # [N * G, L] contiguous
    w_ptr,  # [C] (HAS_W)
    b_ptr,  # [C] (HAS_B)
    y_ptr,  # [N * G, L] contiguous
    L,  # elements of a group: C/G * S
    S,  # elements of a channel: prod(spatial)
    CPG,  # channels per group
    G,
    eps,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # the whole group in one BLOCK: read once, held in registers
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    base = pid * L
    offs = tl.arange(0, BLOCK)
    ch0 = (pid % G) * CPG
    if ONE_PASS:
        # a group that fits in registers (up to 16 K values): x read once, not twice
        ok1 = offs < L
        v1 = tl.load(x_ptr + base + offs, mask=ok1, other=0.0).to(tl.float32)
        mean1 = tl.sum(v1, 0) / L
        d1 = tl.where(ok1, v1 - mean1, 0.0)
        rstd1 = tl.rsqrt(tl.sum(d1 * d1, 0) / L + eps)
    else:
        # walk 1: the group's mean and rstd, chunk by chunk
        mean1, rstd1 = group_stats(x_ptr, base, L, eps, offs, BLOCK)
    # walk 2 (one step when ONE_PASS): normalise, the channel's affine, store in x's dtype
    for start in range(0, L, BLOCK):
        idx = start + offs
        ok = idx < L
        if ONE_PASS:
            y = d1 * rstd1
        else:
            v = tl.load(x_ptr + base + idx, mask=ok, other=0.0).to(tl.float32)
            y = (v - mean1) * rstd1
        if HAS_W or HAS_B:
            ch = ch0 + idx // S
        if HAS_W:
            y = y * tl.load(w_ptr + ch, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + ch, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + base + idx, rn(y, RN).to(y_ptr.dtype.element_ty), mask=ok)


def _gn_tile_fn(
    x_ptr,  # [N * G, CPG, S] contiguous
    w_ptr,  # [C] (HAS_W)
    b_ptr,  # [C] (HAS_B)
    y_ptr,  # [N * G, CPG, S] contiguous
    L,
    S,
    CPG,
    G,
    eps,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BC: tl.constexpr,  # the next power of two of CPG
    BS: tl.constexpr,  # the next power of two of S
    RN: tl.constexpr,
):
    # a group held as a [channels, positions] tile: read once, and the affine is one load
    # of w and b per channel, broadcast along the positions (the flat form divides each
    # element's index by S to find its channel and gathers w and b per element)
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    sp = tl.arange(0, BS)
    c_ok = c < CPG
    ok = c_ok[:, None] & (sp < S)[None, :]
    off = pid * L + c[:, None] * S + sp[None, :]
    v = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(tl.sum(v, 1), 0) / L
    d = tl.where(ok, v - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(tl.sum(d * d, 1), 0) / L + eps)
    ch = (pid % G) * CPG + c
    a = tl.zeros((BC,), tl.float32) + rstd
    if HAS_W:
        a = a * tl.load(w_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)
    y = d * a[:, None]
    if HAS_B:
        y = y + tl.load(b_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + off, rn(y, RN).to(y_ptr.dtype.element_ty), mask=ok)


#: the forward takes a group as a [channels, positions] tile (`_gn_tile_fn`) where that
#: tile wastes at most a fifth of its lanes on padding and fits ONE_PASS_MAX
TILE_2D = True


def _tile(cpg: Any, s: Any) -> tuple[int, int] | None:
    """(BC, BS) of `_gn_tile_fn` for groups of cpg channels of s positions, or None where
    the flat forward is used (symbolic sizes, too large, or too much padding)."""
    if not (TILE_2D and isinstance(cpg, int) and isinstance(s, int)) or cpg * s == 0:
        return None
    bc, bs = 1 << (cpg - 1).bit_length(), 1 << (s - 1).bit_length()
    if bc * bs > ONE_PASS_MAX or 4 * bc * bs > 5 * cpg * s:
        return None
    return bc, bs


def _gn_bwd_fn(
    dy_ptr,  # [N * G, L] contiguous
    x_ptr,  # [N * G, L] contiguous
    w_ptr,  # [C] (HAS_W)
    dx_ptr,  # [N * G, L] contiguous
    dw_ptr,  # [N, C] fp32: sum over the channel's elements of dy * xhat, per sample
    db_ptr,  # [N, C] fp32: sum of dy, per sample
    L,
    S,
    CPG,
    G,
    eps,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
    CBLOCK: tl.constexpr,
    RN: tl.constexpr,
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    base = pid * L
    offs = tl.arange(0, BLOCK)
    mean, rstd = group_stats(x_ptr, base, L, eps, offs, BLOCK)
    # walk 2, channel by channel: the partial dw, db, and the group's two sums through w
    ch0 = (pid % G) * CPG
    coffs = tl.arange(0, CBLOCK)
    sum_dxhat_xhat = 0.0
    sum_dxhat = 0.0
    for j in range(0, CPG):
        cbase = base + j * S
        acc_dyx = tl.zeros((CBLOCK,), dtype=tl.float32)
        acc_dy = tl.zeros((CBLOCK,), dtype=tl.float32)
        for start in range(0, S, CBLOCK):
            idx = start + coffs
            ok = idx < S
            v = tl.load(x_ptr + cbase + idx, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(dy_ptr + cbase + idx, mask=ok, other=0.0).to(tl.float32)
            acc_dyx += g * tl.where(ok, (v - mean) * rstd, 0.0)
            acc_dy += g
        s_dyx = tl.sum(acc_dyx, 0)
        s_dy = tl.sum(acc_dy, 0)
        # pid // G is the sample: its row of the [N, C] partials
        tl.store(dw_ptr + (pid // G) * (G * CPG) + ch0 + j, s_dyx)
        tl.store(db_ptr + (pid // G) * (G * CPG) + ch0 + j, s_dy)
        if HAS_W:
            wj = tl.load(w_ptr + ch0 + j).to(tl.float32)
            sum_dxhat_xhat += wj * s_dyx
            sum_dxhat += wj * s_dy
        else:
            sum_dxhat_xhat += s_dyx
            sum_dxhat += s_dy
    c1 = sum_dxhat_xhat / L
    c2 = sum_dxhat / L
    # walk 3: dx
    for start in range(0, L, BLOCK):
        idx = start + offs
        ok = idx < L
        v = tl.load(x_ptr + base + idx, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + base + idx, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_ptr + ch0 + idx // S, mask=ok, other=0.0).to(tl.float32)
        dx = rstd * (g - c2 - (v - mean) * rstd * c1)
        tl.store(dx_ptr + base + idx, rn(dx, RN).to(dx_ptr.dtype.element_ty), mask=ok)


def _block(n: int, cap: int) -> int:
    """The chunk for walks of n elements: n's next power of two up to cap; cap when n is
    symbolic (torch.export or a dynamic torch.compile traces the launch), which the
    chunked walks take at any n."""
    if not isinstance(n, int):
        return cap
    return max(16, min(cap, 1 << max(0, n - 1).bit_length()))


def _warps(block: int) -> int:
    return 4 if block < 2048 else 8 if block < 8192 else 16


def _sizes(x: torch.Tensor, num_groups: int) -> tuple[int, int, int, int, int]:
    """(N, C, S, channels per group, L) of x [N, C, *spatial]."""
    n, c = x.shape[0], x.shape[1]
    s = math.prod(x.shape[2:])
    cpg = c // num_groups
    return n, c, s, cpg, cpg * s


def triton_forward(x, num_groups, weight, bias, eps) -> torch.Tensor:
    n, _, s, cpg, length = _sizes(x, num_groups)
    xc = x.contiguous()
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if not x.numel():
        return y
    args = (
        xc,
        weight if weight is not None else xc,
        bias if bias is not None else xc,
        y,
        length,
        s,
        cpg,
        num_groups,
        eps,
    )
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, RN=rn_flag(x.dtype))
    tile = _tile(cpg, s)
    if tile is not None:
        wrap_triton(jitted(_gn_tile_fn))[(n * num_groups,)](
            *args, **flags, BC=tile[0], BS=tile[1], num_warps=_warps(tile[0] * tile[1])
        )
    else:
        one_pass = isinstance(length, int) and length <= ONE_PASS_MAX
        block = _block(length, ONE_PASS_MAX if one_pass else MAX_BLOCK)
        wrap_triton(jitted(_gn_fwd_fn))[(n * num_groups,)](
            *args, **flags, BLOCK=block, ONE_PASS=one_pass, num_warps=_warps(block)
        )
    return y


def triton_backward(
    dy, x, num_groups, weight, eps
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db): dw, db [C] in fp32 (the caller casts them to the parameters' dtypes)."""
    n, c, s, cpg, length = _sizes(x, num_groups)
    xc, dyc = x.contiguous(), dy.contiguous()
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    pw = torch.empty((n, c), device=x.device)
    pb = torch.empty((n, c), device=x.device)
    if x.numel():
        block = _block(length, MAX_BLOCK)
        wrap_triton(jitted(_gn_bwd_fn))[(n * num_groups,)](
            dyc,
            xc,
            weight if weight is not None else xc,
            dx,
            pw,
            pb,
            length,
            s,
            cpg,
            num_groups,
            eps,
            HAS_W=weight is not None,
            BLOCK=block,
            CBLOCK=_block(s, MAX_CHANNEL_BLOCK),
            RN=rn_flag(x.dtype),
            num_warps=_warps(block),
        )
        return dx, pw.sum(0), pb.sum(0)
    zero = torch.zeros(c, device=x.device)
    return dx, zero, zero.clone()


def _torch_backward(dy, x, num_groups, weight, eps):
    n, c = x.shape[0], x.shape[1]
    xf, dyf = x.float().reshape(n, num_groups, -1), dy.float().reshape(n, num_groups, -1)
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xc * rstd
    dxhat = dyf
    if weight is not None:
        dxhat = (dyf.reshape(n, c, -1) * weight.float().reshape(1, c, 1)).reshape(dyf.shape)
    dx = rstd * (
        dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
    )
    dw = (dyf * xhat).reshape(n, c, -1).sum((0, 2))
    db = dyf.reshape(n, c, -1).sum((0, 2))
    return dx.reshape(x.shape).to(x.dtype), dw, db


def _group_class(shape: list[int], num_groups: int) -> tuple[int, int]:
    """The crossover's (hidden, rows) of x [N, C, *spatial]: a group's element count, and
    the number of groups N x G."""
    groups = shape[0] * num_groups
    numel = 1
    for d in shape:
        numel *= d
    return (numel // groups if groups else 0), groups


def _kernel_takes(x: torch.Tensor, num_groups: int) -> bool:
    return (
        runs_triton(x)
        and x.dim() >= 2
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and num_groups > 0
        and x.shape[1] % num_groups == 0
    )


@triton_op("opswap::group_norm", mutates_args=())
def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """GroupNorm of x [N, C, *spatial] over num_groups groups of channels (weight and bias
    [C], either optional). On CPU (outside the interpreter), for float64, and where C is
    not a multiple of num_groups it is `F.group_norm` (which says what is wrong). The
    output is channels-last where x is (kernels._layout.channels_last_of), as ATen's, and
    contiguous otherwise, whichever computes it."""
    fmt = channels_last_of(x) or torch.contiguous_format
    if _kernel_takes(x, num_groups) and not compiles_to_reference(
        "group_norm", x, lambda s: _group_class(s, num_groups)
    ):
        return as_promised(triton_forward(x, num_groups, weight, bias, eps), fmt)
    return as_promised(F.group_norm(in_format(x, fmt), num_groups, weight, bias, eps), fmt)


@triton_op("opswap::group_norm_backward", mutates_args=())
def group_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of group_norm, dw and db [C] in fp32."""
    if _kernel_takes(x, num_groups):
        return triton_backward(dy, x, num_groups, weight, eps)
    return _torch_backward(dy, x, num_groups, weight, eps)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, num_groups, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.num_groups, ctx.eps = num_groups, eps
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    dx, dw, db = group_norm_backward(dy, x, ctx.num_groups, weight, ctx.eps)
    return (
        dx,
        None,
        dw.to(weight.dtype) if weight is not None else None,
        db.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None,
        None,
    )


group_norm.register_autograd(_backward, setup_context=_setup)


def instance_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """InstanceNorm of x [N, C, *spatial] from its own statistics (`F.instance_norm` with
    no running stats): GroupNorm with one channel a group."""
    return group_norm(x, x.shape[1], weight, bias, eps)
