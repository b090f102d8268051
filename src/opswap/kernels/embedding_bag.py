"""Table-batched embedding bags as `opswap::batched_embedding_bag`: T tables concatenated
into one weight [R, D] (table t's rows start at offsets[t]), looked up together with
indices [B, T, L] (bag of L per sample and table), pooled by sum or mean, optionally
weighted per sample; the output is [B, T, D]. A float16/bfloat16 table, or an int8 one with
a float32 scale and bias per row (value = q * scale + bias), is dequantized as it is read.

Why it is faster than a loop over tables: the loop launches one gather (and one pooling)
per table, T launches that each read a few KB; the batched op is one launch whose programs
each own one (sample, table) bag and load its L rows as one [L, D] tile (L row reads in
flight at once), so the time goes to the row bytes: B T L D x the table's element size read,
B T D x 4 written. An int8 table reads a quarter of float32's row bytes (plus 8 bytes of
scale and bias per row), a float16 table half.

CPU and anything the kernel does not take: one gather over the concatenated table
(`reference`: F.embedding_bag over the bags of every table at once for a float table of
the output's dtype, else one indexing of the rows then the dequantizing and the pooling),
still one set of ops for all T tables instead of T sets.

Semantics: a sum in float32 in bag order (F.embedding_bag's and the loop's sums round the
same terms, in another order for long bags); an empty bag (L = 0) pools to 0 in either
mode, as F.embedding_bag does. Indices are not range-checked: an index past its table's
rows reads the next table's (the reference raises only past the concatenated weight's end).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from opswap.kernels._rows import KernelError, jitted, runs_triton, tl
from opswap.kernels._triton_op import triton_op

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("batched_embedding_bag",)
#: bag entries one program loads at once
BLOCK_L = 32


def _dtype_out(weight: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    return torch.float32 if weight.dtype == torch.int8 else weight.dtype


def reference(
    weight: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The pooled bags [B, T, D] by one gather over the concatenated table."""
    b, t, n = indices.shape
    dt = _dtype_out(weight, out_dtype)
    rows = indices + offsets.view(1, t, 1)
    if n == 0:
        return torch.zeros((b, t, weight.shape[1]), dtype=dt, device=weight.device)
    psw = per_sample_weights
    if scale is None and weight.dtype == dt and not (mean and psw is not None):
        out = F.embedding_bag(
            rows.reshape(b * t, n),
            weight,
            mode="mean" if mean else "sum",
            per_sample_weights=None if psw is None else psw.reshape(b * t, n).to(dt),
        )
        return out.reshape(b, t, -1)
    vals = weight[rows].float()  # [B, T, L, D]
    if scale is not None and bias is not None:
        vals = vals * scale[rows].unsqueeze(-1) + bias[rows].unsqueeze(-1)
    if psw is not None:
        vals = vals * psw.float().unsqueeze(-1)
    pooled = vals.mean(2) if mean else vals.sum(2)
    return pooled.to(dt)


# ----------------------------------------------------------------------------- the kernel


def _bag_fn(
    w_ptr,  # [R, D] float or int8
    off_ptr,  # [T] int64: the first row of each table
    idx_ptr,  # [B, T, L] int64 contiguous
    psw_ptr,  # [B, T, L] or a dummy (HAS_PSW)
    scale_ptr,  # [R] float32 or a dummy (QUANT)
    bias_ptr,  # [R] float32 or a dummy (QUANT)
    out_ptr,  # [B, T, D]
    T,
    L,
    D,
    MEAN: tl.constexpr,
    HAS_PSW: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # program (bag, column block): the bag's L rows as [BLOCK_L, BLOCK_D] tiles
    bag = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dok = d < D
    base = tl.load(off_ptr + bag % T)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(0, L, BLOCK_L):
        li = start + tl.arange(0, BLOCK_L)
        lok = li < L
        r = tl.load(idx_ptr + bag * L + li, mask=lok, other=0) + base
        ok = lok[:, None] & dok[None, :]
        v = tl.load(w_ptr + r[:, None] * D + d[None, :], mask=ok, other=0).to(tl.float32)
        if QUANT:
            sc = tl.load(scale_ptr + r, mask=lok, other=0.0)
            bi = tl.load(bias_ptr + r, mask=lok, other=0.0)
            v = tl.where(ok, v * sc[:, None] + bi[:, None], 0.0)
        if HAS_PSW:
            v = v * tl.load(psw_ptr + bag * L + li, mask=lok, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(v, 0)
    if MEAN:
        acc = acc / tl.maximum(L, 1).to(tl.float32)
    tl.store(out_ptr + bag * D + d, acc.to(out_ptr.dtype.element_ty), mask=dok)


def triton_forward(
    weight: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    b, t, n = indices.shape
    d = weight.shape[1]
    out = torch.empty((b, t, d), device=weight.device, dtype=_dtype_out(weight, out_dtype))
    if b * t and d:
        idx = indices.contiguous()
        psw = per_sample_weights.contiguous() if per_sample_weights is not None else idx
        quant = scale is not None and bias is not None
        block_d = min(128, max(16, 1 << (d - 1).bit_length()))
        wrap_triton(jitted(_bag_fn))[(b * t, -(-d // block_d))](
            weight.contiguous(), offsets.contiguous(), idx, psw,
            scale if quant else weight, bias if quant else weight, out,
            t, n, d,
            MEAN=mean, HAS_PSW=per_sample_weights is not None, QUANT=quant,
            BLOCK_L=BLOCK_L, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out


def _check(
    weight: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    psw: torch.Tensor | None,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    if weight.dim() != 2 or indices.dim() != 3 or offsets.dim() != 1:
        raise KernelError(
            "opswap::batched_embedding_bag takes a weight [R, D], offsets [T] and indices "
            f"[B, T, L]; got {list(weight.shape)}, {list(offsets.shape)}, {list(indices.shape)}."
        )
    if offsets.shape[0] != indices.shape[1]:
        raise KernelError(
            f"{offsets.shape[0]} table offsets for indices of {indices.shape[1]} tables; "
            "give one offset per table."
        )
    if psw is not None and psw.shape != indices.shape:
        raise KernelError(
            f"per-sample weights {list(psw.shape)} do not match the indices {list(indices.shape)}."
        )
    if weight.dtype == torch.int8 and (scale is None or bias is None):
        raise KernelError("an int8 table needs its scale and bias per row.")


# ----------------------------------------------------------------------------- the op


@triton_op("opswap::batched_embedding_bag", mutates_args=())
def batched_embedding_bag(
    weight: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """T embedding bags at once over one concatenated table: [B, T, D]."""
    _check(weight, offsets, indices, per_sample_weights, scale, bias)
    if runs_triton(weight) and weight.dtype != torch.float64:
        return triton_forward(
            weight, offsets, indices, per_sample_weights, mean, scale, bias, out_dtype
        )
    return reference(weight, offsets, indices, per_sample_weights, mean, scale, bias, out_dtype)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 rows with a float32 scale and bias each (asymmetric, min..max over 255 steps):
    value = q * scale + bias, error at most scale / 2 per element."""
    w = weight.float()
    lo, hi = w.amin(1), w.amax(1)
    scale = ((hi - lo) / 255.0).clamp_min(1e-12)
    bias = lo + 128.0 * scale
    q = torch.round((w - bias[:, None]) / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale, bias
