"""One row chunk of the fused linear + cross-entropy (kernels/linear_cross_entropy.py): from
a chunk of logits, each row's loss and log-sum-exp and, where asked, the gradient of the
loss with respect to the logits, written over the logits (or into a buffer of the GEMM's
dtype). A Triton kernel (GPU, or the interpreter) and the same arithmetic in PyTorch.

For a row x of V logits (bias added), target t, smoothing e and soft cap c:

    z = c * tanh(x / c)               (without a cap, z = x)
    lse = log(sum_j exp(z_j))
    loss = lse - (1 - e) * z_t - (e / V) * sum_j z_j        (0 for an ignored row)
    dz_j = softmax(z)_j - e / V - (1 - e) * [j = t]
    dx_j = scale * dz_j * (1 - (z_j / c)^2)                 (the tanh's derivative; 1 without a cap)

`scale` is what multiplies the row's loss in the reduction (1 / the count of counted rows
for "mean", 1 for "sum", the incoming gradient of the row for "none"), 0 for an ignored
row. This is PyTorch's cross_entropy with label smoothing (the smoothing term is the mean
of -log softmax over the classes).
"""

from __future__ import annotations

import torch

from opswap.kernels._rows import jitted, rn, rn_flag, tl, triton

# Named `_row_logits` where it is defined, as `rn` is (kernels/_rows.py): both passes of
# the kernel read a block of logits this way.
if triton is not None:

    @triton.jit
    def _row_logits(x_row, b_ptr, c, ok, cap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
        # columns c (mask ok) of one row of logits in fp32, bias added, soft-capped
        x = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
        if SOFTCAP:
            # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both ends (exp overflows to inf,
            # giving 1; underflows to 0, giving -1)
            x = cap * (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0))
        return x

else:  # pragma: no cover
    _row_logits = None  # type: ignore[assignment]


def _lce_chunk_fn(
    x_ptr,  # [R, V] logits of the chunk, row stride sx (fp32, or the GEMM's dtype)
    g_ptr,  # [R, V] dlogits out, row stride sg (may be x_ptr: written over the logits)
    b_ptr,  # [V] bias (HAS_BIAS)
    t_ptr,  # [R] int64 targets
    lse_ptr,  # [R] fp32: written (not HAVE_LSE) or read (HAVE_LSE)
    loss_ptr,  # [R] fp32 per-row loss (not HAVE_LSE)
    scale_ptr,  # [R] or [1] fp32: what multiplies each row's gradient
    V,
    sx,
    sg,
    ignore_index,
    smoothing,
    cap,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAVE_LSE: tl.constexpr,
    SCALE_PER_ROW: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    RN_G: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
):
    # One row a program. Pass 1 reads the row once (an online log-sum-exp per lane, the
    # target's logit and the row's sum); pass 2 reads it again and writes dlogits: the
    # chunk's logits cross memory 2 times in and once out, against eager's softmax /
    # subtract / scale written out (some 6 passes over a [N, V] tensor that is never
    # materialised here).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    smoothing = tl.cast(smoothing, tl.float32)
    cap = tl.cast(cap, tl.float32)
    t = tl.load(t_ptr + row)
    counted = t != ignore_index
    if HAVE_LSE:
        lse = tl.load(lse_ptr + row)
    else:
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        zsum = tl.zeros([BLOCK], tl.float32)
        zt = tl.zeros([BLOCK], tl.float32)
        for off in range(0, V, BLOCK):
            c = off + cols
            ok = c < V
            x = _row_logits(x_ptr + row * sx, b_ptr, c, ok, cap, HAS_BIAS, SOFTCAP)
            zsum += tl.where(ok, x, 0.0)
            zt += tl.where(c == t, x, 0.0)
            x = tl.where(ok, x, -1e30)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.where(ok, tl.exp(x - m_new), 0.0)
            m = m_new
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
        loss = lse - (1.0 - smoothing) * tl.sum(zt, 0) - smoothing / V * tl.sum(zsum, 0)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(counted, loss, 0.0))
    if WRITE_GRAD:
        if SCALE_PER_ROW:
            scale = tl.load(scale_ptr + row)
        else:
            scale = tl.load(scale_ptr)
        scale = tl.where(counted, scale, 0.0)
        for off in range(0, V, BLOCK):
            c = off + cols
            ok = c < V
            x = _row_logits(x_ptr + row * sx, b_ptr, c, ok, cap, HAS_BIAS, SOFTCAP)
            g = tl.exp(x - lse) - smoothing / V - tl.where(c == t, 1.0 - smoothing, 0.0)
            if SOFTCAP:
                u = x / cap
                g = g * (1.0 - u * u)
            tl.store(g_ptr + row * sg + c, rn(g * scale, RN_G).to(g_ptr.dtype.element_ty), mask=ok)


def triton_chunk(
    x: torch.Tensor,
    grad_out: torch.Tensor | None,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    loss: torch.Tensor | None,
    scale: torch.Tensor,
    ignore_index: int,
    smoothing: float,
    cap: float | None,
) -> None:
    """Run `_lce_chunk_fn` over the rows of x [R, V]: fill lse and loss [R] (when `loss` is
    given; otherwise lse is read) and, with `grad_out` [R, V], write dlogits there (it may
    be x itself). `scale` is [R] or [1] fp32."""
    r, v = x.shape
    if r == 0:
        return
    block = min(4096, max(16, 1 << (v - 1).bit_length()))
    g = grad_out if grad_out is not None else x
    jitted(_lce_chunk_fn)[(r,)](
        x,
        g,
        bias if bias is not None else x,
        target,
        lse,
        loss if loss is not None else lse,
        scale,
        v,
        x.stride(0),
        g.stride(0),
        ignore_index,
        smoothing,
        cap if cap is not None else 1.0,
        HAS_BIAS=bias is not None,
        SOFTCAP=cap is not None,
        HAVE_LSE=loss is None,
        SCALE_PER_ROW=scale.numel() != 1,
        WRITE_GRAD=grad_out is not None,
        BLOCK=block,
        RN_G=rn_flag(g.dtype),
        num_warps=8 if block >= 2048 else 4,
    )


def torch_chunk(
    x: torch.Tensor,
    want_grad: bool,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor | None,
    scale: torch.Tensor,
    ignore_index: int,
    smoothing: float,
    cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss [R], lse [R], dlogits [R, V] or None): the kernel's arithmetic in PyTorch (in
    float32, float64 for float64 logits), for the CPU. With `lse` given the loss is not
    computed (a zero row). x is the caller's scratch: the gradient is written over it
    where the dtypes allow (one [R, V] buffer, plus one for a soft cap's derivative)."""
    z = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if bias is not None:
        z.add_(bias.to(z.dtype))
    if cap is not None:
        z.div_(cap).tanh_().mul_(cap)
    v = z.shape[-1]
    counted = target != ignore_index
    tc = torch.where(counted, target, 0).clamp(0, max(v - 1, 0))[:, None]
    if lse is None:
        lse = torch.logsumexp(z, -1)
        zt = z.gather(1, tc)[:, 0]
        loss = lse - (1.0 - smoothing) * zt - smoothing / v * z.sum(-1)
        loss = torch.where(counted, loss, torch.zeros_like(loss))
    else:
        loss = torch.zeros_like(lse)
    if not want_grad:
        return loss, lse, None
    deriv = None
    if cap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - (z / cap)^2, before z is overwritten
        deriv = torch.square(z / cap).neg_().add_(1.0)
    g = z.sub_(lse[:, None].to(z.dtype)).exp_()
    if smoothing:
        g.sub_(smoothing / v)
    g.scatter_add_(1, tc, torch.full_like(g[:, :1], smoothing - 1.0))
    if deriv is not None:
        g.mul_(deriv)
    rows = scale.reshape(-1, 1) if scale.numel() != 1 else scale.reshape(1, 1)
    return loss, lse, g.mul_(torch.where(counted[:, None], rows, torch.zeros_like(rows)))
