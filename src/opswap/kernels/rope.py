"""Rotary position embedding applied to q and k in one launch, forward and backward: the
op `opswap::rope` (and `opswap::rope_backward`).

The function (x a row of D elements of q [B, Hq, S, D] or k [B, Hk, S, D] at position s,
c and s' the rows of cos and sin for it; fp32 math, one rounding at the store):

    y = x * c + rot(x) * s'

- Hugging Face's Llama form (`rotate_half`): rot(x) = cat(-x[D/2:], x[:D/2]), with
  cos/sin = cat(freqs, freqs) so that element i and i + D/2 turn by the same angle;
- GPT-J's interleaved form (`interleaved=True`): rot(x)[2i] = -x[2i+1],
  rot(x)[2i+1] = x[2i], with each angle repeated twice (repeat_interleave).

Written as rot(x)[i] = sign_i * x[p(i)] with p an involution (i <-> i + D/2, or 2i <-> 2i+1)
and sign -1 on the first of each pair. cos and sin are [S, D] (shared by the batch),
[B, S, D] or HF's [B, 1, S, D] (from the position ids, as LlamaRotaryEmbedding returns
them), or a table [P, D] read at `positions` ([S] or [B, S] integers).

Backward: the rotation is orthogonal, so dx = dy * c - sign_i dy[p(i)] s'[p(i)]: the
rotation by -theta when c and s' are symmetric in each pair (as they are for both
forms). cos and sin get gradients (sum over heads of dy * x and dy * rot(x), PyTorch)
only when they require them; RoPE tables never do.

Why it is faster (bf16, q and k of n elements together): HF's apply_rotary_pos_emb runs
per tensor mul, two slices, neg, cat, mul, add: the cat writes rot(x) (2 bytes per
element) and reads back, neg writes and reads half, the muls write two products read
by the add: about 2 (x) + 1 + 1 (neg) + 2 + 2 (cat) + 2 + 2 + 2 + 2 (muls) + 2 + 2 + 2
(add) = 22 bytes per element plus cos and sin, against the kernel's 4 (read x, write y)
plus cos and sin once per (b, s), for q and k in one launch.

CPU and anything the kernel does not take: the same formula in PyTorch (`reference`).
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
    runs_triton,
    tl,
)
from opswap.kernels._triton_op import triton_op

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("rope",)


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """rot(x): HF's rotate_half, or GPT-J's pairwise rotation."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def tables(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as [B or 1, 1, S, D], read at `positions` when given."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]  # [S, D] or [B, S, D]
    if cos.dim() == 4:
        return cos, sin
    if cos.dim() == 2:
        return cos[None, None], sin[None, None]
    return cos[:, None], sin[:, None]


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q', k') in PyTorch with fp32 math (float64 for float64), in the promoted dtype."""
    c, s = tables(cos, sin, positions)
    out = []
    for x in (q, k):
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(work)
        y = xf * c.to(work) + rotate(xf, interleaved) * s.to(work)
        out.append(y.to(torch.promote_types(x.dtype, cos.dtype)))
    return out[0], out[1]


# ----------------------------------------------------------------------------- the kernels


def _rope_fn(
    q_ptr,  # [B, Hq, S, D], strides sqb, sqh, sqs, 1
    k_ptr,  # [B, Hk, S, D], strides skb, skh, sks, 1
    c_ptr,  # cos: row (b, s) at b * scb + s * scs, or at pos * scs with positions
    s_ptr,  # sin: the same strides
    p_ptr,  # positions (HAS_POS): (b, s) at b * spb + s * sps
    qo_ptr,  # [B, Hq, S, D] contiguous
    ko_ptr,  # [B, Hk, S, D] contiguous
    HQ,
    HK,
    S,
    D,
    sqb,
    sqh,
    sqs,
    skb,
    skh,
    sks,
    scb,
    scs,
    spb,
    sps,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,  # rotate by -theta: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
    HAS_POS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # positions a program
    BLOCK_H: tl.constexpr,  # the next power of two of D / 2
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
):
    # program (b * (Hq + Hk) + head, block of BLOCK_S positions): a [BLOCK_S, D] tile of
    # one head, read once and written once as its two halves of each pair (x1, x2: the
    # row's halves for rotate_half, its even and odd elements interleaved), so no element
    # is loaded twice; cos and sin of those positions are read once per head (from L2
    # after the first). A program of a few KB keeps enough loads in flight where one row
    # of D (256 bytes) a program did not.
    bh = tl.program_id(0).to(tl.int64)
    b = bh // (HQ + HK)
    h = bh % (HQ + HK)
    s = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s < S
    if h < HQ:
        src = q_ptr + b * sqb + h * sqh + s * sqs
        dst = qo_ptr + ((b * HQ + h) * S + s) * D
    else:
        src = k_ptr + b * skb + (h - HQ) * skh + s * sks
        dst = ko_ptr + ((b * HK + h - HQ) * S + s) * D
    if HAS_POS:
        t = tl.load(p_ptr + b * spb + s * sps, mask=s_ok, other=0).to(tl.int64) * scs
    else:
        t = b * scb + s * scs
    j = tl.arange(0, BLOCK_H)
    if INTERLEAVED:
        i1 = 2 * j
        i2 = 2 * j + 1
    else:
        i1 = j
        i2 = j + D // 2
    ok = s_ok[:, None] & (j < D // 2)[None, :]
    i1, i2 = i1[None, :], i2[None, :]
    x1 = tl.load(src[:, None] + i1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src[:, None] + i2, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + t[:, None] + i1, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + t[:, None] + i2, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + t[:, None] + i1, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + t[:, None] + i2, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    out = qo_ptr.dtype.element_ty
    tl.store(dst[:, None] + i1, rn(y1, RN).to(out), mask=ok)
    tl.store(dst[:, None] + i2, rn(y2, RN).to(out), mask=ok)


def _check(q, k, cos, sin, positions) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise KernelError(
            f"rope takes q [B, Hq, S, D] and k [B, Hk, S, D]; got {list(q.shape)} and "
            f"{list(k.shape)}."
        )
    if q.shape[-1] % 2:
        raise KernelError(f"rope needs an even head dim; got {q.shape[-1]}.")
    if cos.shape != sin.shape or cos.shape[-1] != q.shape[-1]:
        raise KernelError(
            f"cos {list(cos.shape)} and sin {list(sin.shape)} must be one shape ending in "
            f"the head dim {q.shape[-1]}."
        )


def _table_strides(cos, positions, b, s) -> tuple[torch.Tensor, int, int] | None:
    """(cos as rows of D, stride over the batch, stride over the positions), or None
    for a shape the kernel does not index."""
    if positions is not None:
        return (cos, 0, cos.stride(0)) if cos.dim() == 2 and cos.stride(1) == 1 else None
    c = cos[:, 0] if cos.dim() == 4 and cos.shape[1] == 1 else cos
    if c.stride(-1) != 1:
        return None
    if c.dim() == 2 and c.shape[0] == s:
        return c, 0, c.stride(0)
    if c.dim() == 3 and c.shape[1] == s and c.shape[0] in (1, b):
        return c, (c.stride(0) if c.shape[0] == b else 0), c.stride(1)
    return None


def triton_apply(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    interleaved: bool,
    backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q', k') by one `_rope_fn` launch (the backward's rotation with `backward`)."""
    _check(q, k, cos, sin, positions)
    b, hq, s, d = q.shape
    hk = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    dtype = torch.promote_types(q.dtype, cos.dtype)
    qo = torch.empty((b, hq, s, d), device=q.device, dtype=dtype)
    ko = torch.empty((b, hk, s, d), device=k.device, dtype=dtype)
    ct = _table_strides(cos, positions, b, s)
    st = _table_strides(sin, positions, b, s)
    if ct is None or st is None or ct[1:] != st[1:]:
        raise KernelError(
            f"cos {list(cos.shape)} and sin {list(sin.shape)} are not [S, D], [B, S, D] or "
            "[B, 1, S, D] with unit stride (or a [P, D] table with positions); pass them so."
        )
    pos = positions if positions is not None else q
    sp: tuple[int, ...] = (0, 0)
    if positions is not None:
        sp = (0, positions.stride(0)) if positions.dim() == 1 else tuple(positions.stride())
    if b and s and hq + hk:
        block_h = max(8, 1 << (d // 2 - 1).bit_length())
        # 16 positions of D = 128 a program, 4 warps: the best of 8 to 64 positions and 2
        # to 8 warps on an H100 (2.82 TB/s against 2.28 for the 64 positions used before;
        # results/tune_rows_h100.json). A flat kernel in Inductor's layout (an element, its
        # partner and its angle a lane, any strides) measured 2.74 there and was dropped
        block_s = max(1, min(1024 // block_h, 1 << (s - 1).bit_length()))
        wrap_triton(jitted(_rope_fn))[(b * (hq + hk), -(-s // block_s))](
            q,
            k,
            ct[0],
            st[0],
            pos,
            qo,
            ko,
            hq,
            hk,
            s,
            d,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            ct[1],
            ct[2],
            sp[0],
            sp[1],
            INTERLEAVED=interleaved,
            BACKWARD=backward,
            HAS_POS=positions is not None,
            BLOCK_S=block_s,
            BLOCK_H=block_h,
            RN=rn_flag(dtype),
            num_warps=4,
        )
    return qo, ko


def _torch_backward(dq, dk, cos, sin, positions, interleaved, dtypes):
    """The rotation by -theta in PyTorch: dx = dy c + rot^T(dy s')."""
    c, s = tables(cos, sin, positions)
    out = []
    for dy, dt in zip((dq, dk), dtypes, strict=True):
        work = torch.float64 if dy.dtype == torch.float64 else torch.float32
        g, cw, sw = dy.to(work), c.to(work), s.to(work)
        out.append((g * cw - rotate(g * sw, interleaved)).to(dt))  # rot^T = -rot
    return out[0], out[1]


def _kernel_takes(q, k, cos, sin, positions) -> bool:
    if not runs_triton(q) or torch.float64 in (q.dtype, cos.dtype):
        return False
    if q.dtype != k.dtype or cos.dtype != sin.dtype or q.device != cos.device:
        return False
    try:
        _check(q, k, cos, sin, positions)
    except KernelError:
        return False
    b, s = q.shape[0], q.shape[2]
    ct, st = _table_strides(cos, positions, b, s), _table_strides(sin, positions, b, s)
    return ct is not None and st is not None and ct[1:] == st[1:]


def _rope_class(shape: list[int]) -> tuple[int, int]:
    """The crossover's (hidden, rows) of q [B, H, S, D]: the head dim, and the rows of q and
    k together (the benchmark's k is q's shape)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return shape[-1], 2 * rows


# ----------------------------------------------------------------------------- the ops


@triton_op("opswap::rope", mutates_args=())
def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q', k'): the rotary embedding of q [B, Hq, S, D] and k [B, Hk, S, D] in one launch."""
    if _kernel_takes(q, k, cos, sin, positions) and not compiles_to_reference(
        "rope", q, _rope_class
    ):
        return triton_apply(q, k, cos, sin, positions, interleaved)
    qo, ko = reference(q, k, cos, sin, positions, interleaved)
    return qo.contiguous(), ko.contiguous()  # as the kernel writes them


@triton_op("opswap::rope_backward", mutates_args=())
def rope_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    interleaved: bool,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) of rope: the rotation by -theta of the output gradients."""
    if _kernel_takes(dq, dk, cos, sin, positions) and dq.dtype == q_dtype == k_dtype:
        return triton_apply(dq, dk, cos, sin, positions, interleaved, backward=True)
    gq, gk = _torch_backward(dq, dk, cos, sin, positions, interleaved, (q_dtype, k_dtype))
    return gq.contiguous(), gk.contiguous()  # as the kernel writes them


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, cos, sin, positions, interleaved = inputs
    ctx.interleaved, ctx.dtypes = interleaved, (q.dtype, k.dtype)
    tables_need = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    ctx.save_for_backward(cos, sin, positions, *((q, k) if tables_need else (None, None)))


def _backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple:
    cos, sin, positions, q, k = ctx.saved_tensors
    gq, gk = rope_backward(dq, dk, cos, sin, positions, ctx.interleaved, *ctx.dtypes)
    dcos = dsin = None
    if q is not None:  # a table that trains: d/dc = sum over heads of dy x, d/ds of dy rot(x)
        c, _ = tables(cos, sin, positions)
        gc = (dq.float() * q.float()).sum(1, keepdim=True) + (dk.float() * k.float()).sum(
            1, keepdim=True
        )
        gs = (dq.float() * rotate(q.float(), ctx.interleaved)).sum(1, keepdim=True) + (
            dk.float() * rotate(k.float(), ctx.interleaved)
        ).sum(1, keepdim=True)
        if positions is not None:
            dcos = torch.zeros_like(cos, dtype=torch.float32)
            dsin = torch.zeros_like(sin, dtype=torch.float32)
            idx = positions.expand(q.shape[0], q.shape[2]) if positions.dim() == 1 else positions
            dcos.index_put_((idx,), gc[:, 0], accumulate=True)
            dsin.index_put_((idx,), gs[:, 0], accumulate=True)
        else:
            dcos, dsin = gc.sum_to_size(c.shape), gs.sum_to_size(c.shape)
            dcos, dsin = dcos.reshape(cos.shape), dsin.reshape(sin.shape)
        dcos, dsin = dcos.to(cos.dtype), dsin.to(sin.dtype)
    return gq, gk, dcos, dsin, None, None


rope.register_autograd(_backward, setup_context=_setup)
