"""LayerNorm over the last dim, forward and backward: the op `opswap::layer_norm` (and
`opswap::layer_norm_backward`).

    mean = x.mean(-1), var = ((x - mean) ** 2).mean(-1), rstd = rsqrt(var + eps)
    y = ((x - mean) * rstd * w + b).to(x.dtype)         fp32 math inside

which is what `F.layer_norm` computes for bf16/fp16/fp32 on CPU and CUDA (it, too,
accumulates and applies the affine in fp32 and casts once).

Why a kernel of our own when PyTorch's is one kernel too: ATen's forward writes the mean
and rstd of each row for its backward, and its backward runs two kernels (dx, then the
column sums for dw and db, reading x and dy again). Ours reads x once and writes y once
(4 bytes per element in bf16) in the forward, and in the backward reads x and dy once,
writes dx once and sums dw, db per program in registers (6 bytes per element), with mean
and rstd recomputed from the row it already holds. The gain is in the backward and in
the launches; the forward is at parity when both run at the copy bandwidth (the
crossover table, kernels/crossover.py, holds what was measured).

Backward, with xhat = (x - mean) * rstd and dxhat = dy * w:
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
    dw = sum over rows of dy * xhat,  db = sum over rows of dy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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
CROSSOVER = ("layer_norm",)


def reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """The function in PyTorch (fp32 math for low-precision x, float64 for float64 x): the
    tests' ground truth when run on float64 inputs."""
    xf = x.float() if x.dtype != torch.float64 else x
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def _ln_fwd_fn(
    x_ptr,  # [M, N], row stride sx
    w_ptr,  # [N] (HAS_W)
    b_ptr,  # [N] (HAS_B)
    y_ptr,  # [M, N] contiguous
    N,
    sx,
    eps,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
):
    # one row per program: read x once, write y once; the two moments from registers
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    eps = tl.cast(eps, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / N
    xc = tl.where(ok, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, 0) / N + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, rn(y, RN).to(y_ptr.dtype.element_ty), mask=ok)


def _ln_bwd_fn(
    dy_ptr,  # [M, N] contiguous
    x_ptr,  # [M, N], row stride sx
    w_ptr,  # [N] (HAS_W)
    dx_ptr,  # [M, N] contiguous
    dw_ptr,  # [programs, N] fp32 partials of dw
    db_ptr,  # [programs, N] fp32 partials of db
    M,
    N,
    sx,
    eps,
    ROWS,  # rows per program, a multiple of RB
    RB: tl.constexpr,  # rows a step holds: [RB, BLOCK] tiles
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
    RN: tl.constexpr,
):
    # x and dy of a step's rows are loaded before the first reduction (in flight together)
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    ok = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros((RB, BLOCK), dtype=tl.float32)
    db = tl.zeros((RB, BLOCK), dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS
    for i in range(0, ROWS, RB):
        row = (first + i + tl.arange(0, RB))[:, None]
        m = ok & (row < M)
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        mean = (tl.sum(x, 1) / N)[:, None]
        xc = tl.where(ok, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, 1) / N + eps)[:, None]
        xhat = xc * rstd
        dw += dy * xhat
        db += dy
        dxhat = dy * w if HAS_W else dy
        c1 = (tl.sum(dxhat * xhat, 1) / N)[:, None]
        c2 = (tl.sum(dxhat, 1) / N)[:, None]
        dx = rstd * (dxhat - c2 - xhat * c1)
        tl.store(dx_ptr + row * N + cols, rn(dx, RN).to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid * N + cols, tl.sum(dw, 0)[None, :], mask=ok)
    tl.store(db_ptr + pid * N + cols, tl.sum(db, 0)[None, :], mask=ok)


def triton_forward(x, weight, bias, eps) -> torch.Tensor:
    n = x.shape[-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m:
        block, warps = row_settings(n)
        wrap_triton(jitted(_ln_fwd_fn))[(m,)](
            x2,
            weight if weight is not None else x2,
            bias if bias is not None else x2,
            y,
            n,
            x2.stride(0),
            eps,
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            BLOCK=block,
            RN=rn_flag(x.dtype),
            num_warps=warps,
        )
    return y.reshape(x.shape)


def triton_backward(dy, x, weight, eps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db): dw, db in fp32 (the caller casts them to the parameters' dtypes)."""
    n = x.shape[-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    dy2 = dy.reshape(m, n).contiguous()
    dx = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = backward_grid(m, n, x.device, "layer_norm")
    pw = torch.empty((grid.programs, n), device=x.device)
    pb = torch.empty((grid.programs, n), device=x.device)
    if m:
        wrap_triton(jitted(_ln_bwd_fn))[(grid.programs,)](
            dy2,
            x2,
            weight if weight is not None else x2,
            dx,
            pw,
            pb,
            m,
            n,
            x2.stride(0),
            eps,
            grid.rows,
            RB=grid.rb,
            HAS_W=weight is not None,
            BLOCK=grid.block,
            RN=rn_flag(x.dtype),
            num_warps=grid.warps,
        )
        return dx.reshape(x.shape), pw.sum(0), pb.sum(0)
    zero = torch.zeros(n, device=x.device)
    return dx.reshape(x.shape), zero, zero.clone()


def _torch_backward(dy, x, weight, eps):
    xf, dyf = x.float(), dy.float()
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xc * rstd
    dxhat = dyf * weight.float() if weight is not None else dyf
    dx = rstd * (
        dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
    )
    n = x.shape[-1]
    return dx.to(x.dtype), (dyf * xhat).reshape(-1, n).sum(0), dyf.reshape(-1, n).sum(0)


def _kernel_takes(x: torch.Tensor) -> bool:
    return runs_triton(x) and 0 < x.shape[-1] <= MAX_ROW and x.dtype != torch.float64


@triton_op("opswap::layer_norm", mutates_args=())
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of x [..., N] over its last dim (weight and bias [N], either optional)."""
    if _kernel_takes(x) and not compiles_to_reference("layer_norm", x):
        return triton_forward(x, weight, bias, eps)
    n = x.shape[-1]
    return F.layer_norm(x, (n,), weight, bias, eps)


@triton_op("opswap::layer_norm_backward", mutates_args=())
def layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of layer_norm, dw and db in fp32."""
    if _kernel_takes(x):
        return triton_backward(dy, x, weight, eps)
    return _torch_backward(dy, x, weight, eps)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    dx, dw, db = layer_norm_backward(dy, x, weight, ctx.eps)
    return (
        dx,
        dw.to(weight.dtype) if weight is not None else None,
        db.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None,
        None,
    )


layer_norm.register_autograd(_backward, setup_context=_setup)
