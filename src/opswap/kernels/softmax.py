"""Row softmax and log-softmax over the last dim, and scale + mask + softmax fused, forward
and backward: the ops `opswap::softmax`, `opswap::log_softmax` and
`opswap::masked_softmax` (with `_backward` ops of their own).

The function (z the row, fp32 math whatever the input dtype; y in `dtype`, or x's):

    z = x * scale + mask          (masked_softmax; a boolean mask keeps where True and
                                   sets the rest to -inf; mask broadcasts to x, e.g. an
                                   attention mask [B, 1, 1, S] or [B, 1, S, S] on
                                   scores [B, H, S, S])
    y = exp(z - max z) / sum(exp(z - max z))            softmax (the safe softmax)
    y = z - max z - log(sum(exp(z - max z)))            log_softmax

A row that fits one block (N <= SINGLE_MAX) is loaded once into registers: one read of x,
one write of y. A longer row takes the online softmax (Milakov and Gimelshein, 2018):
one pass over the row's tiles keeps, per lane, the running max m and the running sum d
of exp(z - m), rescaling d by exp(m_old - m_new) whenever the max grows; the lanes then
combine (M = max m, D = sum d * exp(m - M)), and a second pass writes exp(z - M) / D.
That reads x twice and writes y once, against eager's max / sub / exp / sum / div
written out (five passes) or aten's softmax (two reads, one write, the same as ours).
The gain over eager's own softmax is in the fused mask: eager's scale and mask add each
write and re-read a score tensor (B H S S elements), the kernel reads x and the mask
(broadcast, so a fraction of x) and writes y: 2 + 2 bytes per element in bf16 instead
of 2 + 2 (mul) + 2 + 2 + 2 (add) + 2 + 2 (softmax) = 14 with fp32 scores twice that.

Backward (y saved by the forward, s = sum over the row):
    softmax:      dx = scale * y * (dy - s(dy * y))
    log_softmax:  dx = scale * (dy - exp(y) * s(dy))
one read of y and dy and one write of dx for a row that fits; a longer row sums first,
then writes. A float mask that needs a gradient gets y * (dy - s(dy * y)) summed over
the dims it broadcast over.

A row with every entry -inf (fully masked) is NaN, as eager's softmax makes it.
CPU, float64, more than 4 dims for the mask, and anything the kernel does not take: the
same formulas in PyTorch (`reference`, `_torch_backward`), so the ops run everywhere.
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

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("softmax", "log_softmax", "masked_softmax")

#: the longest row the forward holds in registers in one block (32 warps: 32 values a
#: thread); longer rows take the online softmax. Measured on an H100 (bf16, GPU time,
#: results/tune_rows_h100.json): 4096 rows of 32768 in one block with 32 warps 2.82 TB/s
#: against the online softmax's best 2.30 (tiles of 8192, 16 warps); 8192 rows of 16384
#: 3.00 against 2.53; Liger-Kernel, which holds such rows in one block too, 2.82 and 2.99
SINGLE_MAX = 32768
#: the backward's (dy and y both held: twice the registers a row). Measured on an H100
#: (bf16, GPU time, results/tune_rows_softmax_backward_rope_h100.json): 4096 rows of 32768
#: in one block 2.93 TB/s (32 warps) against 1.86 for tiles of 8192 (compile 3.04, Liger
#: 3.03); 8192 rows of 16384 3.06 against 2.50 (compile 2.28, Liger 3.04)
SINGLE_MAX_BACKWARD = 32768
#: the tile the online softmax walks a longer row in, and its warps (the best of tiles of
#: 2 K to 16 K and 4 to 16 warps in the same run)
TILE, TILE_WARPS = 8192, 16


def _work(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scores(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    z = x.to(_work(x)) * scale if scale != 1.0 else x.to(_work(x))
    if mask is None:
        return z
    if mask.dtype == torch.bool:
        return z.masked_fill(~mask, float("-inf"))
    return z + mask.to(z.dtype)


def reference(
    x: torch.Tensor,
    log: bool = False,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The function in PyTorch (fp32 math, float64 for float64 inputs), cast to `dtype`
    (x's by default): the tests' ground truth on float64 inputs."""
    z = _scores(x, mask, scale)
    y = torch.log_softmax(z, -1) if log else torch.softmax(z, -1)
    return y.to(dtype or x.dtype)


# ----------------------------------------------------------------------------- the kernels


def _softmax_fwd_fn(
    x_ptr,  # [M, N], row stride sx
    m_ptr,  # the mask (MASK), broadcast: element (i0, i1, i2, n) at i0 sm0 + i1 sm1 + ...
    y_ptr,  # [M, N] contiguous
    N,
    sx,
    sm0,
    sm1,
    sm2,
    smn,
    D1,  # the rows' leading dims, rows = D0 * D1 * D2 (for the mask's index)
    D2,
    scale,
    LOG: tl.constexpr,
    MASK: tl.constexpr,  # 0 none, 1 additive, 2 boolean (keep where true)
    ONLINE: tl.constexpr,  # the row is longer than one block: two passes over its tiles
    BLOCK: tl.constexpr,
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    scale = tl.cast(scale, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * sx
    y_row = y_ptr + row * N
    m_row = m_ptr
    if MASK != 0:
        i2 = row % D2
        i1 = (row // D2) % D1
        i0 = row // (D1 * D2)
        m_row = m_ptr + i0 * sm0 + i1 * sm1 + i2 * sm2
    cols = tl.arange(0, BLOCK)
    if not ONLINE:
        ok = cols < N
        z = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) * scale
        if MASK == 1:
            z += tl.load(m_row + cols * smn, mask=ok, other=0.0).to(tl.float32)
        if MASK == 2:
            z = tl.where(tl.load(m_row + cols * smn, mask=ok, other=0) != 0, z, float("-inf"))
        z = tl.where(ok, z, float("-inf"))
        mx = tl.max(z, 0)
        e = tl.exp(z - mx)
        d = tl.sum(e, 0)
        if LOG:
            y = z - mx - tl.log(d)
        else:
            y = e / d
        tl.store(y_row + cols, rn(y, RN).to(y_ptr.dtype.element_ty), mask=ok)
    else:
        # pass 1: per lane, the running max and the sum of exp(z - max), rescaled
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        d = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, N, BLOCK):
            c = start + cols
            ok = c < N
            z = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32) * scale
            if MASK == 1:
                z += tl.load(m_row + c * smn, mask=ok, other=0.0).to(tl.float32)
            if MASK == 2:
                z = tl.where(tl.load(m_row + c * smn, mask=ok, other=0) != 0, z, float("-inf"))
            z = tl.where(ok, z, float("-inf"))
            m_new = tl.maximum(m, z)
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
            d = d * tl.exp(m - base) + tl.exp(z - base)
            m = m_new
        mx = tl.max(m, 0)
        base = tl.where(mx == float("-inf"), 0.0, mx)
        total = tl.sum(d * tl.exp(m - base), 0)
        # pass 2: write
        for start in range(0, N, BLOCK):
            c = start + cols
            ok = c < N
            z = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32) * scale
            if MASK == 1:
                z += tl.load(m_row + c * smn, mask=ok, other=0.0).to(tl.float32)
            if MASK == 2:
                z = tl.where(tl.load(m_row + c * smn, mask=ok, other=0) != 0, z, float("-inf"))
            if LOG:
                y = z - mx - tl.log(total)
            else:
                y = tl.exp(z - mx) / total
            tl.store(y_row + c, rn(y, RN).to(y_ptr.dtype.element_ty), mask=ok)


def _softmax_bwd_fn(
    dy_ptr,  # [M, N] contiguous
    y_ptr,  # [M, N] contiguous: the forward's output
    dx_ptr,  # [M, N] contiguous
    N,
    scale,
    LOG: tl.constexpr,
    ONLINE: tl.constexpr,
    BLOCK: tl.constexpr,
    RN: tl.constexpr,
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    scale = tl.cast(scale, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if not ONLINE:
        ok = cols < N
        dy = tl.load(dy_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp(y) * tl.sum(dy, 0)
        else:
            dx = y * (dy - tl.sum(dy * y, 0))
        tl.store(dx_ptr + row * N + cols, rn(dx * scale, RN).to(dx_ptr.dtype.element_ty), mask=ok)
    else:
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, N, BLOCK):
            c = start + cols
            ok = c < N
            dy = tl.load(dy_ptr + row * N + c, mask=ok, other=0.0).to(tl.float32)
            if LOG:
                acc += dy
            else:
                acc += dy * tl.load(y_ptr + row * N + c, mask=ok, other=0.0).to(tl.float32)
        s = tl.sum(acc, 0)
        for start in range(0, N, BLOCK):
            c = start + cols
            ok = c < N
            dy = tl.load(dy_ptr + row * N + c, mask=ok, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + row * N + c, mask=ok, other=0.0).to(tl.float32)
            if LOG:
                dx = dy - tl.exp(y) * s
            else:
                dx = y * (dy - s)
            tl.store(dx_ptr + row * N + c, rn(dx * scale, RN).to(dx_ptr.dtype.element_ty), mask=ok)


def _blocking(n: int, single_max: int) -> tuple[int, bool, int]:
    """(BLOCK, ONLINE, num_warps) for rows of n elements."""
    if n <= single_max:
        block = max(16, 1 << (n - 1).bit_length())
        warps = 4 if block < 2048 else 8 if block < 8192 else 16 if block == 8192 else 32
        return block, False, warps
    return TILE, True, TILE_WARPS


def _mask_view(mask: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, list[int], list[int]]:
    """(the mask expanded to x's shape as a view, strides (sm0, sm1, sm2, smn), leading
    sizes (D0, D1, D2)) with x's leading dims padded to three."""
    if len(shape) > 4:
        raise KernelError(
            f"a masked softmax over {len(shape)} dims is more than the kernel's 4 "
            "([B, H, S, S] scores); reshape the scores to 4 dims."
        )
    try:
        me = mask.expand(shape)
    except RuntimeError:
        raise KernelError(
            f"the mask {list(mask.shape)} does not broadcast to the scores {list(shape)}; "
            "give a mask that does."
        ) from None
    pad = 4 - len(shape)
    sizes = [1] * pad + list(shape[:-1])
    strides = [0] * pad + list(me.stride()[:-1])
    return me, [*strides, me.stride(-1)], sizes


def triton_forward(
    x: torch.Tensor,
    log: bool,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    single_max: int = SINGLE_MAX,
) -> torch.Tensor:
    """y by `_softmax_fwd_fn` on x [..., N]; `single_max` lower than SINGLE_MAX sends
    shorter rows through the online path (the tests use it)."""
    n = x.shape[-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=dtype or x.dtype)
    if m and n:
        block, online, warps = _blocking(n, single_max)
        if mask is not None:
            me, st, sizes = _mask_view(mask, x.shape)
            kind = 2 if mask.dtype == torch.bool else 1
        else:
            me, st, sizes, kind = x2, [0, 0, 0, 0], [1, 1, 1], 0
        wrap_triton(jitted(_softmax_fwd_fn))[(m,)](
            x2,
            me,
            y,
            n,
            x2.stride(0),
            *st,
            sizes[1],
            sizes[2],
            scale,
            LOG=log,
            MASK=kind,
            ONLINE=online,
            BLOCK=block,
            RN=rn_flag(y.dtype),
            num_warps=warps,
        )
    return y.reshape(x.shape)


def triton_backward(
    dy: torch.Tensor,
    y: torch.Tensor,
    log: bool,
    scale: float,
    dtype: torch.dtype,
    single_max: int = SINGLE_MAX_BACKWARD,
) -> torch.Tensor:
    """dx (in `dtype`, the input's) by `_softmax_bwd_fn`."""
    n = y.shape[-1]
    y2 = y.reshape(-1, n).contiguous()
    m = y2.shape[0]
    dy2 = dy.reshape(m, n).contiguous()
    dx = torch.empty((m, n), device=y.device, dtype=dtype)
    if m and n:
        block, online, warps = _blocking(n, single_max)
        wrap_triton(jitted(_softmax_bwd_fn))[(m,)](
            dy2,
            y2,
            dx,
            n,
            scale,
            LOG=log,
            ONLINE=online,
            BLOCK=block,
            RN=rn_flag(dtype),
            num_warps=warps,
        )
    return dx.reshape(y.shape)


def _torch_backward(dy, y, log, scale, dtype):
    """The kernel's backward in PyTorch (fp32 math)."""
    work = torch.float64 if y.dtype == torch.float64 else torch.float32
    dyf, yf = dy.to(work), y.to(work)
    if log:
        dz = dyf - yf.exp() * dyf.sum(-1, keepdim=True)
    else:
        dz = yf * (dyf - (dyf * yf).sum(-1, keepdim=True))
    return (dz * scale).to(dtype)


def _kernel_takes(x: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    if not runs_triton(x) or x.dtype == torch.float64 or x.dim() == 0:
        return False
    if mask is None:
        return True
    if mask.device != x.device or mask.dtype == torch.float64 or x.dim() > 4:
        return False
    try:
        torch.broadcast_shapes(mask.shape, x.shape)
    except RuntimeError:
        return False
    return torch.broadcast_shapes(mask.shape, x.shape) == x.shape


# ----------------------------------------------------------------------------- the ops


@triton_op("opswap::softmax", mutates_args=())
def softmax(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax(x, -1), computed in fp32, returned in `dtype` (x's by default)."""
    if _kernel_takes(x) and not compiles_to_reference("softmax", x):
        return triton_forward(x, False, dtype=dtype)
    return reference(x, False, dtype=dtype)


@triton_op("opswap::log_softmax", mutates_args=())
def log_softmax(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """log_softmax(x, -1), computed in fp32, returned in `dtype` (x's by default)."""
    if _kernel_takes(x) and not compiles_to_reference("log_softmax", x):
        return triton_forward(x, True, dtype=dtype)
    return reference(x, True, dtype=dtype)


@triton_op("opswap::masked_softmax", mutates_args=())
def masked_softmax(
    x: torch.Tensor, mask: torch.Tensor | None, scale: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """softmax(x * scale + mask, -1); a boolean mask keeps where True. The mask
    broadcasts to x (at most 4 dims)."""
    if _kernel_takes(x, mask) and not compiles_to_reference("masked_softmax", x):
        return triton_forward(x, False, mask, scale, dtype)
    return reference(x, False, mask, scale, dtype)


@triton_op("opswap::softmax_backward", mutates_args=())
def softmax_backward(
    dy: torch.Tensor, y: torch.Tensor, log: bool, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """dx of (log_)softmax(x * scale) from y and dy, in `dtype`."""
    if _kernel_takes(y) and dy.shape == y.shape:
        return triton_backward(dy, y, log, scale, dtype)
    return _torch_backward(dy, y, log, scale, dtype).contiguous()  # as the kernel writes it


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(output)
    ctx.in_dtype = inputs[0].dtype


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    (y,) = ctx.saved_tensors
    return softmax_backward(dy, y, False, 1.0, ctx.in_dtype), None


def _backward_log(ctx: Any, dy: torch.Tensor) -> tuple:
    (y,) = ctx.saved_tensors
    return softmax_backward(dy, y, True, 1.0, ctx.in_dtype), None


def _setup_masked(ctx: Any, inputs: tuple, output: Any) -> None:
    x, mask, scale = inputs[0], inputs[1], inputs[2]
    ctx.save_for_backward(output)
    ctx.in_dtype, ctx.scale = x.dtype, scale
    ctx.mask_shape = tuple(mask.shape) if mask is not None else None
    ctx.mask_dtype = mask.dtype if mask is not None else None


def _backward_masked(ctx: Any, dy: torch.Tensor) -> tuple:
    (y,) = ctx.saved_tensors
    dmask = None
    if ctx.needs_input_grad[1] and ctx.mask_shape is not None:
        dz = softmax_backward(dy, y, False, 1.0, torch.float32)
        dmask = dz.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)
        dx = (dz * ctx.scale).to(ctx.in_dtype) if ctx.needs_input_grad[0] else None
    else:
        dx = softmax_backward(dy, y, False, ctx.scale, ctx.in_dtype)
    return dx, dmask, None, None


softmax.register_autograd(_backward, setup_context=_setup)
log_softmax.register_autograd(_backward_log, setup_context=_setup)
masked_softmax.register_autograd(_backward_masked, setup_context=_setup_masked)
