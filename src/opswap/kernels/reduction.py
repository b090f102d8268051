"""Reductions over the last dim, one program per row: sum, mean, max, var, and the fused
producers sum of squares (sum x*x), mean of squares and sum of a product (sum x*y), as
the ops `opswap::row_reduce` (one tensor) and `opswap::row_dot` (two), with backward.

Each program walks its row in tiles of BLOCK elements (tl.arange over a tile, looping
over the row, so any row length takes one launch), keeps one fp32 accumulator per lane,
and reduces the lanes once at the end (tl.sum / tl.max over the tile): a block-level
reduction, the lanes of a tile spread over the warps of the program.

var takes each tile's mean and sum of squared deviations from the tile in registers
(two passes over registers, one read of x), and merges them into the row's running
count, mean and M2 once per tile by Chan et al.'s formula (for parts a and b:
delta = mean_b - mean_a, mean = mean_a + delta n_b / n, M2 = M2_a + M2_b
+ delta^2 n_a n_b / n): no catastrophic cancellation of E[x^2] - E[x]^2, and no division
per element, which Welford's update per lane costs (a division is about ten instructions:
that made the per-lane form slower than reading x, 1.79 TB/s on the H200 at 32768 x 4096
against torch.compile's 2.10). `unbiased` divides M2 by N - 1 (torch.var's default),
else by N.

Why the fused producers are faster (bf16, rows of N): eager's x.pow(2).sum(-1) writes
x*x (2 bytes per element) and reads it back (2) on top of reading x (2), 6 bytes per
element against the kernel's 2; (x * y).sum(-1), 8 against 4. The plain sum, mean, max
and var are single aten kernels already: ours is the same traffic (one read of x), here
to show the block reduction and as the base of the fused ones.

Backward: sum dx = dy broadcast over the row (returned as an expanded view: nothing to
write); mean dy / N broadcast; sum of squares dx = 2 x dy (a Triton kernel: one read of
x, one write of dx; mean of squares 2 x dy / N); sum of a product dx = dy y, dy' = dy x;
var dx = 2 (x - mean) dy / (N - c); max splits dy evenly among a row's maxima, as
torch.amax's backward does (PyTorch, both).

CPU and anything the kernel does not take: the same formulas in PyTorch (`reference`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.library import wrap_triton

from opswap.kernels._rows import (
    KernelError,
    compiles_to_reference,
    jitted,
    rn,
    rn_flag,
    rows_of,
    runs_triton,
    tl,
)
from opswap.kernels._triton_op import triton_op

#: what `row_reduce` computes, by the name it takes
OPS = ("sum", "mean", "max", "var", "sumsq", "meansq")
_OP_ID = {o: i for i, o in enumerate(OPS)}
#: the crossover table's kernel name of each op that has one
_CROSSOVER = {"sum": "row_sum", "var": "row_var", "sumsq": "row_sumsq", "meansq": "row_sumsq"}
#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = tuple(dict.fromkeys(_CROSSOVER.values()))
#: the tile a program walks its row in
BLOCK = 2048


def _check_op(op: str) -> int:
    if op not in _OP_ID:
        raise KernelError(f"reduction {op!r} is not one of {', '.join(OPS)}; pick one of those.")
    return _OP_ID[op]


def reference(
    x: torch.Tensor, op: str, unbiased: bool = True, keepdim: bool = False
) -> torch.Tensor:
    """The reduction in PyTorch with fp32 accumulation (float64 for float64), in x's dtype."""
    _check_op(op)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    if op == "sum":
        r = xf.sum(-1, keepdim=keepdim)
    elif op == "mean":
        r = xf.mean(-1, keepdim=keepdim)
    elif op == "max":
        r = xf.amax(-1, keepdim=keepdim)
    elif op == "var":
        r = xf.var(-1, correction=1 if unbiased else 0, keepdim=keepdim)
    elif op == "sumsq":
        r = (xf * xf).sum(-1, keepdim=keepdim)
    else:
        r = (xf * xf).mean(-1, keepdim=keepdim)
    return r.to(x.dtype)


def reference_dot(x: torch.Tensor, y: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(work) * y.to(work)).sum(-1, keepdim=keepdim).to(x.dtype)


# ----------------------------------------------------------------------------- the kernels


def _reduce_fn(
    x_ptr,  # [M, N], row stride sx
    y_ptr,  # [M, N], row stride sy (OP == 6: the product's other factor)
    out_ptr,  # [M]
    N,
    sx,
    sy,
    correction,
    OP: tl.constexpr,  # 0 sum, 1 mean, 2 max, 3 var, 4 sumsq, 5 meansq, 6 dot
    BLOCK: tl.constexpr,
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    if OP == 2:
        acc = tl.full((BLOCK,), float("-inf"), tl.float32)
    # var: the row's count, mean and M2 so far, merged with each tile's (fp32 scalars)
    cnt = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
    mean = cnt
    m2 = cnt
    for start in range(0, N, BLOCK):
        c = start + cols
        ok = c < N
        x = tl.load(x_ptr + row * sx + c, mask=ok, other=0.0).to(tl.float32)
        if OP == 2:
            acc = tl.maximum(acc, tl.where(ok, x, float("-inf")), propagate_nan=tl.PropagateNan.ALL)
        elif OP == 3:
            nt = tl.minimum(N - start, BLOCK).to(tl.float32)
            mt = tl.sum(x, 0) / nt
            d = tl.where(ok, x - mt, 0.0)
            tot = cnt + nt
            delta = mt - mean
            mean += delta * (nt / tot)
            m2 += tl.sum(d * d, 0) + delta * delta * (cnt * (nt / tot))
            cnt = tot
        elif OP == 4 or OP == 5:
            acc += x * x
        elif OP == 6:
            acc += x * tl.load(y_ptr + row * sy + c, mask=ok, other=0.0).to(tl.float32)
        else:
            acc += x
    if OP == 2:
        r = tl.max(acc, 0)  # a lane's NaN is kept through the row, as torch.amax keeps it
        r = tl.where(tl.sum(tl.where(acc != acc, 1, 0), 0) > 0, float("nan"), r)
    elif OP == 3:
        r = m2 / (N - correction)
    elif OP == 1 or OP == 5:
        r = tl.sum(acc, 0) / N
    else:
        r = tl.sum(acc, 0)
    tl.store(out_ptr + row, rn(r, RN).to(out_ptr.dtype.element_ty))


def _sumsq_bwd_fn(
    x_ptr,  # [M, N], row stride sx
    dy_ptr,  # [M]
    dx_ptr,  # [M, N] contiguous
    N,
    sx,
    factor,  # 2, or 2 / N for the mean of squares
    BLOCK: tl.constexpr,
    RN: tl.constexpr,
):
    # program (row, tile): read x once, write dx = factor * x * dy once
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    factor = tl.cast(factor, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < N
    x = tl.load(x_ptr + row * sx + c, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row).to(tl.float32)
    tl.store(dx_ptr + row * N + c, rn(factor * x * dy, RN).to(dx_ptr.dtype.element_ty), mask=ok)


#: var's tile: up to 4096 elements, 8 warps (an H100 at 32768 x 4096: 3.10 TB/s against
#: 2.54 in tiles of 2048 and torch.compile's 2.08; results/tune_rows_h100.json)
VAR_BLOCK = 4096


def _block(n: int, op: int = 0) -> tuple[int, int]:
    block = min(VAR_BLOCK if op == 3 else BLOCK, max(16, 1 << (n - 1).bit_length()))
    return block, 4 if block < 1024 else 8


def triton_forward(
    x: torch.Tensor,
    op: str,
    unbiased: bool = True,
    keepdim: bool = False,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reduction by `_reduce_fn` over x [..., N]'s last dim (`y` given: sum x*y)."""
    ident = 6 if y is not None else _check_op(op)
    n = x.shape[-1]
    x2 = rows_of(x)
    y2 = rows_of(y) if y is not None else x2
    m = x2.shape[0]
    out = torch.empty((m,), device=x.device, dtype=x.dtype)
    if m:
        block, warps = _block(max(n, 1), ident)
        wrap_triton(jitted(_reduce_fn))[(m,)](
            x2,
            y2,
            out,
            n,
            x2.stride(0),
            y2.stride(0),
            1.0 if unbiased else 0.0,
            OP=ident,
            BLOCK=block,
            RN=rn_flag(x.dtype),
            num_warps=warps,
        )
    shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
    return out.reshape(shape)


def triton_sumsq_backward(dy: torch.Tensor, x: torch.Tensor, factor: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    dx = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m and n:
        block, warps = _block(n)
        wrap_triton(jitted(_sumsq_bwd_fn))[(m, -(-n // block))](
            x2,
            dy.reshape(m).contiguous(),
            dx,
            n,
            x2.stride(0),
            factor,
            BLOCK=block,
            RN=rn_flag(x.dtype),
            num_warps=warps,
        )
    return dx.reshape(x.shape)


def _kernel_takes(x: torch.Tensor, y: torch.Tensor | None = None) -> bool:
    if not runs_triton(x) or x.dtype == torch.float64 or x.dim() == 0:
        return False
    if not x.dtype.is_floating_point or x.shape[-1] == 0:
        return False
    return y is None or (y.shape == x.shape and y.dtype == x.dtype and y.device == x.device)


# ----------------------------------------------------------------------------- the ops


@triton_op("opswap::row_reduce", mutates_args=())
def row_reduce(x: torch.Tensor, op: str, unbiased: bool, keepdim: bool) -> torch.Tensor:
    """op over x's last dim: sum, mean, max, var (unbiased or not), sumsq, meansq."""
    _check_op(op)
    measured = _CROSSOVER.get(op)
    if _kernel_takes(x) and not (measured and compiles_to_reference(measured, x)):
        return triton_forward(x, op, unbiased, keepdim)
    return reference(x, op, unbiased, keepdim)


@triton_op("opswap::row_dot", mutates_args=())
def row_dot(x: torch.Tensor, y: torch.Tensor, keepdim: bool) -> torch.Tensor:
    """sum(x * y) over the last dim of two tensors of one shape, in one pass."""
    if _kernel_takes(x, y):
        return triton_forward(x, "sum", keepdim=keepdim, y=y)
    return reference_dot(x, y, keepdim)


@triton_op("opswap::row_sumsq_backward", mutates_args=())
def row_sumsq_backward(dy: torch.Tensor, x: torch.Tensor, factor: float) -> torch.Tensor:
    """dx = factor * x * dy (dy one value per row): the backward of sumsq and meansq."""
    if _kernel_takes(x) and dy.numel() == x.numel() // max(x.shape[-1], 1):
        return triton_sumsq_backward(dy, x, factor)
    dx = (factor * x.float() * dy.reshape(*x.shape[:-1], 1).float()).to(x.dtype)
    return dx.contiguous()  # as the kernel writes it


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, op, unbiased, keepdim = inputs
    ctx.op, ctx.unbiased, ctx.keepdim = op, unbiased, keepdim
    ctx.save_for_backward(x, output if op == "max" else None)


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, out = ctx.saved_tensors
    n, op = x.shape[-1], ctx.op
    d = dy if ctx.keepdim else dy.unsqueeze(-1)
    if op in ("sum", "mean"):
        dx = (d if op == "sum" else d / n).to(x.dtype).expand(x.shape)
    elif op in ("sumsq", "meansq"):
        dx = row_sumsq_backward(d, x, 2.0 if op == "sumsq" else 2.0 / n)
    elif op == "var":
        xf = x.float()
        dx = (2 * (xf - xf.mean(-1, keepdim=True)) * d.float() / (n - int(ctx.unbiased))).to(
            x.dtype
        )
    else:
        hit = x == (out if ctx.keepdim else out.unsqueeze(-1))
        dx = (d * hit / hit.sum(-1, keepdim=True)).to(x.dtype)
    return dx, None, None, None


def _setup_dot(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.keepdim = inputs[2]


def _backward_dot(ctx: Any, dy: torch.Tensor) -> tuple:
    x, y = ctx.saved_tensors
    d = dy if ctx.keepdim else dy.unsqueeze(-1)
    return (d * y).to(x.dtype), (d * x).to(y.dtype), None


row_reduce.register_autograd(_backward, setup_context=_setup)
row_dot.register_autograd(_backward_dot, setup_context=_setup_dot)
