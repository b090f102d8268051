"""Attention of one new query token per sequence over a static KV cache, split-K
("flash-decoding"): the op `opswap::decode_attention`.

    from opswap.kernels.decode_attention import decode_attention
    o = decode_attention(q, k_cache, v_cache, lengths)   # q [B, H, 1, D] -> o [B, H, 1, D]

k_cache and v_cache are [B, H_kv, S_max, D], preallocated once; `lengths` (int32 [B]) says
how many of their keys are valid per sequence. Lengths are a tensor, not Python ints, so
one CUDA graph of a decode step serves every step: the kernels read them on the device.

Why split the keys. A decode step at batch 1 does almost no arithmetic: per kv head it
reads L keys and L values of D elements once (2·L·D·bytes) and multiplies them with a
few query rows. It is memory-bound, and the only question is how many SMs pull the bytes.
FlashAttention's grid (query blocks x heads) gives B·H programs, one query row each: at
batch 1 that is 32 programs for 132 SMs, each streaming the whole cache of its head. Here
the keys are cut into `splits` chunks and the grid is (B·H_kv, splits): each program
reads one chunk of one kv head once, for all GROUP = H / H_kv query heads of that kv head
together (GQA's K/V bytes are read once, not GROUP times), and writes a partial output
and its log-sum-exp per query head (fp32, [B, H, splits, D + 1]: small next to the cache).
A second kernel, one program per (b, h), combines the splits:

    o = Σ_s exp(lse_s - max lse) · o_s / Σ_s exp(lse_s - max lse)

Chunks past `lengths[b]` return at once and are not read by the combine. The split count
comes from S_max and the GPU's SM count (`plan_splits`), never from the lengths, so it is
the same at every step of a captured graph.

Head dims 64 and 128; fp16 and bf16 (tensor cores, fp32 accumulation), fp32 (IEEE fp32
dots). GQA with H a multiple of H_kv. Anything else runs the reference (`unsupported`
says why). Inference only: asking for a gradient raises.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.library import wrap_triton

from opswap.kernels._rows import (
    KernelError,
    interpreting,
    jitted,
    rn,
    rn_flag,
    runs_triton,
    tl,
    triton,
)
from opswap.kernels._triton_op import triton_op

__all__ = [
    "HEAD_DIMS",
    "decode_attention",
    "plan_splits",
    "reference",
    "triton_decode",
    "unsupported",
]

HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634
#: keys per split come in multiples of this (the largest BLOCK_N a split must hold whole)
SPLIT_QUANTUM = 64
#: the most splits per kv head (the combine holds them all in one tile)
MAX_SPLITS = 128
#: the interpreter's key tile and split length
INTERP_BLOCK_N = 16
INTERP_SPLIT = 32
#: (BLOCK_N, num_warps, num_stages) of the split kernel on a GPU, pruned to BLOCK_N <= split
CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (32, 4, 2))


def plan_splits(
    batch: int, kv_heads: int, s_max: int, device: torch.device, splits: int = 0
) -> tuple[int, int]:
    """(splits, keys per split) for a cache of S_max keys.

    On a GPU: enough programs for about two per SM (B·H_kv·splits ≈ 2·SMs), but no split
    shorter than SPLIT_QUANTUM keys and at most MAX_SPLITS; the split length is rounded up
    to a multiple of SPLIT_QUANTUM. In the interpreter: splits of INTERP_SPLIT keys.
    `splits` > 0 asks for that many (rounded the same way; tests use it)."""
    s_max = max(1, s_max)
    quantum = INTERP_BLOCK_N if interpreting() or device.type != "cuda" else SPLIT_QUANTUM
    if splits <= 0:
        if device.type == "cuda" and not interpreting():
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = math.ceil(2 * sms / max(1, batch * kv_heads))
        else:
            splits = math.ceil(s_max / INTERP_SPLIT)
    splits = max(1, min(splits, MAX_SPLITS, math.ceil(s_max / quantum)))
    split_len = math.ceil(math.ceil(s_max / splits) / quantum) * quantum
    return math.ceil(s_max / split_len), split_len


def _decode_split_fn(
    q_ptr,  # [B, H, 1, D]
    k_ptr,  # [B, H_kv, S_max, D]
    v_ptr,  # [B, H_kv, S_max, D]
    len_ptr,  # [B] int32: valid keys per sequence
    o_ptr,  # [B * H, SPLITS, D] fp32: each split's output, normalised within the split
    lse_ptr,  # [B * H, SPLITS] fp32: each split's log2-sum-exp2 of the scaled scores
    qk_scale,  # scale * log2(e)
    sqb,
    sqh,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    H_KV,
    GROUP,  # query heads per kv head
    S_MAX,
    SPLIT_LEN,
    SPLITS,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a tile height tl.dot takes (>= 16)
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,  # the interpreter: its half-precision dot is not a GPU's
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H_KV
    hk = pid % H_KV
    n_keys = tl.minimum(tl.load(len_ptr + b), S_MAX)
    lo = split * SPLIT_LEN
    if lo >= n_keys:  # a chunk wholly past this sequence's keys: nothing to read or write
        return
    hi = tl.minimum(lo + SPLIT_LEN, n_keys)
    g = tl.arange(0, BLOCK_G)
    heads = hk * GROUP + g
    in_group = g < GROUP
    dims = tl.arange(0, D)
    cols = tl.arange(0, BLOCK_N)
    q_base = q_ptr + b.to(tl.int64) * sqb
    q = tl.load(q_base + heads[:, None] * sqh + dims[None, :], mask=in_group[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + cols
        valid = keys < hi
        kt = tl.load(k_base + keys[:, None] * skn + dims[None, :], mask=valid[:, None], other=0.0)
        vt = tl.load(v_base + keys[:, None] * svn + dims[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # every tile holds at least one valid key (start < hi), so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    row = (b * H_KV * GROUP + heads).to(tl.int64) * SPLITS + split
    tl.store(o_ptr + row[:, None] * D + dims[None, :], acc / l_i[:, None], mask=in_group[:, None])
    tl.store(lse_ptr + row, m_i + tl.log2(l_i), mask=in_group)


def _decode_reduce_fn(
    o_part_ptr,  # [B * H, SPLITS, D] fp32
    lse_ptr,  # [B * H, SPLITS] fp32 (log2 domain)
    len_ptr,  # [B] int32
    out_ptr,  # [B, H, 1, D], q's dtype
    sob,
    soh,
    H,
    S_MAX,
    SPLIT_LEN,
    SPLITS,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # SPLITS padded to a power of two
    RN: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    n_keys = tl.minimum(tl.load(len_ptr + b), S_MAX)
    used = tl.arange(0, BLOCK_S) < (n_keys + SPLIT_LEN - 1) // SPLIT_LEN  # splits that wrote
    dims = tl.arange(0, D)
    base = bh.to(tl.int64) * SPLITS
    lse = tl.load(lse_ptr + base + tl.arange(0, BLOCK_S), mask=used, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key at all: every weight is 0
    w = tl.exp2(lse - top)
    parts = tl.load(
        o_part_ptr + (base + tl.arange(0, BLOCK_S))[:, None] * D + dims[None, :],
        mask=used[:, None],
        other=0.0,
    )
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(den > 0.0, den, 1.0)  # 0 when no key
    o = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + dims
    tl.store(o, rn(out, RN).to(out_ptr.dtype.element_ty))


_KERNELS: dict[tuple[str, bool], Any] = {}


def _prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    split = int({**named_args, **kwargs}["SPLIT_LEN"])
    keep = [c for c in configs if c.kwargs["BLOCK_N"] <= split]
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_N"])]


def _kernel(name: str) -> Any:
    """The split kernel (autotuned over CONFIGS on a GPU) or the combine."""
    key = (name, interpreting())
    if key not in _KERNELS:
        if name == "reduce":
            _KERNELS[key] = jitted(_decode_reduce_fn)
        else:
            k = jitted(_decode_split_fn)
            if not interpreting():
                configs = [
                    triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in CONFIGS
                ]
                k = triton.autotune(
                    configs,
                    key=["SPLIT_LEN", "D", "BLOCK_G"],
                    prune_configs_by={"early_config_prune": _prune},
                )(k)
            _KERNELS[key] = k
    return _KERNELS[key]


def unsupported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> str | None:
    """Why the kernels cannot take these tensors, or None when they can."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != 1:
        return "q must be [batch, heads, 1, head_dim] and the caches [batch, kv_heads, S_max, head_dim]"
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree on batch, heads, length or head dim"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads"
    if lengths.shape != (q.shape[0],) or lengths.dtype not in (torch.int32, torch.int64):
        return (
            f"lengths must be an integer tensor [batch], not {lengths.dtype} {tuple(lengths.shape)}"
        )
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]}: the kernel takes {HEAD_DIMS[0]} or {HEAD_DIMS[1]}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (
        q.dtype == k.dtype == v.dtype
    ):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: the kernel takes one of fp16, bf16, fp32"
    return None


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same attention in PyTorch, in fp32 (float64 for float64 inputs), returned in q's
    dtype: keys at or past lengths[b] are hidden; a sequence with no key gets 0."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.to(work).repeat_interleave(g, dim=1) if g != 1 else t.to(work) for t in (k, v))
    s = (q.to(work) @ kk.transpose(-1, -2)) * scale  # [B, H, 1, S_max]
    keys = torch.arange(k.shape[2], device=q.device)
    hidden = keys[None, :] >= lengths.to(q.device)[:, None]
    s = s.masked_fill(hidden[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vv).to(q.dtype)


def triton_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int = 0,
) -> torch.Tensor:
    """o [B, H, 1, D] (q's dtype) by the split and combine kernels."""
    why = unsupported(q, k, v, lengths)
    if why is not None:
        raise KernelError(f"decode_attention: {why}.")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bsz, h, _, d = q.shape
    hk, s_max = k.shape[1], k.shape[2]
    group = h // hk
    n_splits, split_len = plan_splits(bsz, hk, s_max, q.device, splits)
    out = torch.empty((bsz, h, 1, d), device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    lens = lengths.to(device=q.device, dtype=torch.int32)
    o_part = torch.empty((bsz * h, n_splits, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((bsz * h, n_splits), device=q.device, dtype=torch.float32)
    kw: dict[str, Any] = {
        "D": d,
        "BLOCK_G": max(16, triton.next_power_of_2(group)),
        "PREC": "ieee" if q.dtype == torch.float32 else "tf32",
        "DOT_F32": interpreting(),  # every constexpr passed: inductor's wrapper takes no defaults
    }
    if interpreting():
        kw.update(BLOCK_N=INTERP_BLOCK_N)
    wrap_triton(_kernel("split"))[(bsz * hk, n_splits)](
        q, k, v, lens, o_part, lse, scale * LOG2E,
        q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3],
        hk, group, s_max, split_len, n_splits, **kw,
    )  # fmt: skip
    wrap_triton(_kernel("reduce"))[(bsz * h,)](
        o_part, lse, lens, out, out.stride(0), out.stride(1), h, s_max, split_len, n_splits,
        D=d, BLOCK_S=max(2, triton.next_power_of_2(n_splits)), RN=rn_flag(q.dtype),
    )  # fmt: skip
    return out


@triton_op("opswap::decode_attention", mutates_args=())
def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int,
) -> torch.Tensor:
    """Attention of q [B, H, 1, D] over the first lengths[b] keys of k_cache, v_cache
    [B, H_kv, S_max, D]; `splits` 0 lets `plan_splits` choose."""
    if runs_triton(q) and unsupported(q, k_cache, v_cache, lengths) is None:
        return triton_decode(q, k_cache, v_cache, lengths, scale, splits)
    return reference(q, k_cache, v_cache, lengths, scale).contiguous()


def _no_backward(ctx: Any, grad: torch.Tensor) -> None:
    raise KernelError(
        "opswap::decode_attention is an inference op with no backward; "
        "use opswap::flash_attention or SDPA where a gradient is needed."
    )


_decode_attention.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    splits: int = 0,
) -> torch.Tensor:
    """`opswap::decode_attention`: softmax(q kᵀ · scale) v over each sequence's first
    lengths[b] cached keys; `scale` defaults to 1/sqrt(head_dim). Shapes that are not a
    decode step's raise KernelError; head dims or dtypes the kernels lack run the
    reference."""
    if q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4:
        why = unsupported(q, k_cache, v_cache, lengths)
        structural = why is not None and not why.startswith(("head dim", "dtypes"))
    else:
        why, structural = "q and the caches must be 4-D", True
    if structural:
        raise KernelError(f"decode_attention: {why}.")
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return torch.ops.opswap.decode_attention(q, k_cache, v_cache, lengths, s, int(splits))
