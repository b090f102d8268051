"""Fused RMSNorm, and residual add + RMSNorm, forward and backward: the ops
`opswap::rms_norm` and `opswap::add_rms_norm` (with `_backward` ops of their own).

The function, as Hugging Face's Llama/Qwen/Mistral RMSNorm writes it (rows of N = hidden
elements, fp32 math whatever the input dtype):

    h = x.float() * rsqrt(mean(x.float() ** 2) + eps)
    y = (w + offset) * h.to(x.dtype)          cast_first=True  (LlamaRMSNorm)
    y = ((w + offset) * h).to(x.dtype)        cast_first=False (nn.RMSNorm, F.rms_norm, Gemma)

`offset` is 1.0 for Gemma's `(1 + weight)` and 0.0 otherwise; without a weight, y = h.
The add form first computes `s = x + residual` in x's dtype (rounded as eager's add is),
normalises s, and returns both (y, s): the decoder layer's residual stream.

Why it is faster (bf16, row of N): eager PyTorch runs the formula as 7-8 kernels
(to, pow, mean, add, rsqrt, mul, to, mul), of which to/pow/mul/to/mul each read and write
a tensor the size of x, in fp32 for the upcast ones: about 2 + 8 + 8 + 8 + 6 + 4 + 4 = 40
bytes per element against the kernel's 4 (read x in bf16, write y). The add form saves
the sum's write and re-read on top: 6 bytes per element (read x and the residual, write y
and s) instead of 6 + 40 for add then RMSNorm. torch.compile fuses the same chain into one
kernel; the measured crossover table (kernels/crossover.py) says where ours wins.

Backward: with n = x * rstd, g = w + offset and dn = dy * g,
    dx = rstd * (dn - n * mean(dn * n)),     dw = sum over rows of dy * n
(n rounded to x's dtype first when cast_first, as the forward multiplied it). The kernel
reads x and dy once and writes dx once (6 bytes per element in bf16); rstd is recomputed
from x, which the row's load brings anyway, so the forward stores nothing for it. Each
program takes a contiguous share of the rows and writes one fp32 partial of dw; PyTorch
sums the partials (a few hundred rows of N, against M rows of the input).

CPU (and anything the kernel does not take): the same formulas in PyTorch (`reference`,
`_torch_backward`), so the op runs everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.library import wrap_triton

from opswap.kernels._rows import (
    MAX_ROW,
    backward_grid,
    compiles_to_reference,
    jitted,
    rn,
    rn_flag,
    row_settings,
    rows_of,
    runs_triton,
    tl,
)
from opswap.kernels._triton_op import triton_op

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("rms_norm", "add_rms_norm")


def reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
    cast_first: bool = True,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s): the function in PyTorch, in the module docstring's steps; s = x + residual
    (x itself without a residual). Run on float64 inputs it is the tests' ground truth."""
    s = x if residual is None else x + residual
    xf = s.float() if s.dtype != torch.float64 else s
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(s.dtype), s
    w = weight.to(h.dtype) + offset
    if cast_first:
        return w.to(torch.promote_types(weight.dtype, s.dtype)) * h.to(s.dtype), s
    return (w * h).to(s.dtype), s


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None, cast_first: bool) -> torch.dtype:
    """y's dtype: `weight * h.to(x.dtype)` promotes (an fp32 weight on bf16 x gives fp32);
    the other forms cast back to x's dtype."""
    if weight is not None and cast_first:
        return torch.promote_types(weight.dtype, x.dtype)
    return x.dtype


# ----------------------------------------------------------------------------- the kernels


def _rms_fwd_fn(
    x_ptr,  # [M, N], row stride sx
    r_ptr,  # [M, N] residual (HAS_RES), row stride sr
    w_ptr,  # [N] weight (HAS_W)
    y_ptr,  # [M, N] contiguous
    s_ptr,  # [M, N] contiguous: x + residual (HAS_RES)
    N,
    sx,
    sr,
    eps,
    offset,
    HAS_W: tl.constexpr,
    HAS_RES: tl.constexpr,
    CAST_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
    RN_X: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
    RN_Y: tl.constexpr,
):
    # one row per program: read x (and the residual) once, write y (and s) once
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    eps = tl.cast(eps, tl.float32)
    offset = tl.cast(offset, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * sr + cols, mask=ok, other=0.0)
        x = rn(x.to(tl.float32) + r.to(tl.float32), RN_X).to(x_ptr.dtype.element_ty)  # eager's add
        tl.store(s_ptr + row * N + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    h = xf * rstd
    if CAST_FIRST:
        h = rn(h, RN_X).to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_W:
        h = h * (tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) + offset)
    tl.store(y_ptr + row * N + cols, rn(h, RN_Y).to(y_ptr.dtype.element_ty), mask=ok)


def _rms_bwd_fn(
    dy_ptr,  # [M, N] contiguous
    x_ptr,  # [M, N] the normalised input (s for the add form), row stride sx
    w_ptr,  # [N] (HAS_W)
    dres_ptr,  # [M, N] contiguous: the gradient reaching s from its other readers (HAS_DRES)
    dx_ptr,  # [M, N] contiguous
    dw_ptr,  # [programs, N] fp32 partial weight gradients (HAS_W)
    M,
    N,
    sx,
    eps,
    offset,
    ROWS,  # rows per program, a multiple of RB
    RB: tl.constexpr,  # rows a step holds: [RB, BLOCK] tiles
    HAS_W: tl.constexpr,
    HAS_DRES: tl.constexpr,
    CAST_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
    RN_X: tl.constexpr,
):
    # Each step loads x, dy (and dres) of RB rows before the first reduction, so the
    # loads are in flight together rather than one after another's reduction.
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    eps = tl.cast(eps, tl.float32)
    offset = tl.cast(offset, tl.float32)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    ok = cols < N
    if HAS_W:
        g = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((RB, BLOCK), dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS
    for i in range(0, ROWS, RB):
        row = (first + i + tl.arange(0, RB))[:, None]
        m = ok & (row < M)
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
        dy = tl.load(dy_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_DRES:
            dr = tl.load(dres_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)[:, None]  # as the forward computed it
        n = xf * rstd
        if HAS_W:
            if CAST_FIRST:
                dw += dy * rn(n, RN_X).to(x_ptr.dtype.element_ty).to(tl.float32)
            else:
                dw += dy * n
            dn = dy * g
        else:
            dn = dy
        dx = rstd * (dn - n * (tl.sum(dn * n, 1) / N)[:, None])
        if HAS_DRES:
            dx += dr
        tl.store(dx_ptr + row * N + cols, rn(dx, RN_X).to(dx_ptr.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(dw_ptr + pid * N + cols, tl.sum(dw, 0)[None, :], mask=ok)


def triton_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_first: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s) by `_rms_fwd_fn` on x [..., N]; s is x when there is no residual."""
    n = x.shape[-1]
    x2 = rows_of(x)
    r2 = rows_of(residual) if residual is not None else x2
    m = x2.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=out_dtype(x, weight, cast_first))
    s = torch.empty((m, n), device=x.device, dtype=x.dtype) if residual is not None else x2
    if m:
        block, warps = row_settings(n)
        wrap_triton(jitted(_rms_fwd_fn))[(m,)](
            x2,
            r2,
            weight if weight is not None else x2,
            y,
            s,
            n,
            x2.stride(0),
            r2.stride(0),
            eps,
            offset,
            HAS_W=weight is not None,
            HAS_RES=residual is not None,
            CAST_FIRST=cast_first,
            BLOCK=block,
            RN_X=rn_flag(x.dtype),
            RN_Y=rn_flag(y.dtype),
            num_warps=warps,
        )
    shape = x.shape
    return y.reshape(shape), (s.reshape(shape) if residual is not None else x)


def triton_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    dres: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) by `_rms_bwd_fn`; dw is empty without a weight."""
    n = x.shape[-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    dy2 = dy.reshape(m, n).contiguous()
    dr2 = dres.reshape(m, n).contiguous() if dres is not None else dy2
    dx = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = backward_grid(m, n, x.device, "add_rms_norm" if dres is not None else "rms_norm")
    part = torch.empty((grid.programs, n) if weight is not None else (0,), device=x.device)
    if m:
        wrap_triton(jitted(_rms_bwd_fn))[(grid.programs,)](
            dy2,
            x2,
            weight if weight is not None else x2,
            dr2,
            dx,
            part,
            m,
            n,
            x2.stride(0),
            eps,
            offset,
            grid.rows,
            RB=grid.rb,
            HAS_W=weight is not None,
            HAS_DRES=dres is not None,
            CAST_FIRST=cast_first,
            BLOCK=grid.block,
            RN_X=rn_flag(x.dtype),
            num_warps=grid.warps,
        )
    if weight is None:
        return dx.reshape(x.shape), x.new_empty((0,))
    dw = part.sum(0) if m else torch.zeros(n, device=x.device)
    return dx.reshape(x.shape), dw.to(weight.dtype)


def _torch_backward(dy, x, weight, dres, eps, offset, cast_first):
    """The kernel's backward in PyTorch (fp32 math), for the CPU and for rows too long."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    dyf = dy.float()
    if weight is not None:
        dn = dyf * (weight.float() + offset)
        nw = n.to(x.dtype).float() if cast_first else n
        dw = (dyf * nw).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    else:
        dn, dw = dyf, x.new_empty((0,))
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    if dres is not None:
        dx = dx + dres.float()
    return dx.to(x.dtype), dw


def _kernel_takes(x: torch.Tensor) -> bool:
    return runs_triton(x) and 0 < x.shape[-1] <= MAX_ROW and x.dtype != torch.float64


# ----------------------------------------------------------------------------- the ops


@triton_op("opswap::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast_first: bool
) -> torch.Tensor:
    """RMSNorm of x [..., N] over its last dim; see the module docstring for the forms."""
    if _kernel_takes(x) and not compiles_to_reference("rms_norm", x):
        return triton_forward(x, weight, eps, offset, cast_first)[0]
    return reference(x, weight, eps, offset, cast_first)[0].contiguous()  # as the kernel's


@triton_op("opswap::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    dres: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of rms_norm (dw empty without a weight); `dres` is added to dx (the
    gradient that reaches the add form's sum from its other readers)."""
    if _kernel_takes(x):
        return triton_backward(dy, x, weight, dres, eps, offset, cast_first)
    return _torch_backward(dy, x, weight, dres, eps, offset, cast_first)


@triton_op("opswap::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over the rows."""
    if (
        _kernel_takes(x)
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and not compiles_to_reference("add_rms_norm", x)
    ):
        return triton_forward(x, weight, eps, offset, cast_first, residual)
    y, s = reference(x, weight, eps, offset, cast_first, residual)
    return y.contiguous(), s.contiguous()  # as the kernel writes them


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, weight = inputs[0], inputs[1]
    ctx.save_for_backward(x, weight)
    ctx.args = inputs[2:]


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    eps, offset, cast_first = ctx.args
    dx, dw = rms_norm_backward(dy, x, weight, None, eps, offset, cast_first)
    return dx, (dw if weight is not None else None), None, None, None


def _setup_add(ctx: Any, inputs: tuple, output: Any) -> None:
    weight = inputs[2]
    ctx.save_for_backward(output[1], weight)
    ctx.args = inputs[3:]


def _backward_add(ctx: Any, dy: torch.Tensor, ds: torch.Tensor) -> tuple:
    s, weight = ctx.saved_tensors
    eps, offset, cast_first = ctx.args
    dx, dw = rms_norm_backward(dy, s, weight, ds, eps, offset, cast_first)
    return dx, dx, (dw if weight is not None else None), None, None, None


rms_norm.register_autograd(_backward, setup_context=_setup)
add_rms_norm.register_autograd(_backward_add, setup_context=_setup_add)
