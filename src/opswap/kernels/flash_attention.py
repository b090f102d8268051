"""FlashAttention in Triton, forward and backward: softmax(q kᵀ · scale + mask) v without
the [S_q, S_k] scores ever reaching memory.

    from opswap.kernels.flash_attention import flash_attention
    o = flash_attention(q, k, v, causal=True)        # q [B, H, S_q, D], k, v [B, H_kv, S_k, D]

The kernels are in `_flash_fwd` (online softmax over key tiles, O(S·D) memory traffic
against the O(S²) of matmul-softmax-matmul) and `_flash_bwd` (the FlashAttention-2
backward: δ = rowsum(dO ∘ O), then dK, dV per key block and dQ per query block, no
atomics), launched by `_flash_launch`. What they take:

- `causal`: key j is seen by query i when j <= i, the upper-left alignment that
  `scaled_dot_product_attention(is_causal=True)` uses, also when S_q != S_k; tiles wholly
  above the diagonal are skipped, so causal does about half the work.
- `lengths` (int [B]): the valid keys per batch element, for a batch padded at the end.
- `mask`: boolean (keep where True) or additive float, of any shape that broadcasts to
  [B, H, S_q, S_k] (SDPA's attn_mask; a [B, S_k] key-padding mask as [B, 1, 1, S_k]), read
  through its strides and never expanded in memory. No gradient flows to it.
- A query row that sees no key returns 0, as SDPA's math does.
- Grouped-query attention: k, v have H_kv heads dividing H; query head h reads kv head
  h // (H / H_kv), with no copy of k and v; dK, dV sum over the group in one program.
- Head dims 16 to 256, powers of two (64 and 128 are what models use); fp16 and bf16 on
  tensor cores; fp32 is computed too, with IEEE fp32 dots (as exact as SDPA's fp32, and
  slow: the rule does not pick the kernel for fp32).
- Any scale (1/sqrt(D) by default).

Registered as `opswap::flash_attention` -> (out, lse) and
`opswap::flash_attention_backward` (triton_ops: torch.compile and torch.export see the
kernels; the fake implementations give the shapes), with autograd from the first to the
second. On a CPU tensor outside Triton's interpreter both are the reference (SDPA's math).

Tuning (GPU): every kernel is autotuned over a short config list per (S_q, S_k, D, mask
kind), Hopper-sized tiles first, pruned to the tiles a sequence fills. `set_tma(True)`
(or OPSWAP_FLASH_TMA=1) loads the forward's k and v tiles through device-side tensor
descriptors (the bulk tensor copy engine) on compute capability 9.0 and up, in eager
calls; elsewhere, and by default until measured, plain pointer loads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from opswap.kernels._flash_launch import (
    FWD_CONFIGS,
    HEAD_DIMS,
    set_tma,
    triton_backward,
    triton_forward,
    unsupported,
)
from opswap.kernels._rows import runs_triton
from opswap.kernels._triton_op import triton_op

#: the names the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("flash_attention",)

__all__ = [
    "FWD_CONFIGS",
    "HEAD_DIMS",
    "flash_attention",
    "reference",
    "reference_backward",
    "sdpa",
    "set_tma",
    "triton_backward",
    "triton_forward",
    "unsupported",
]


def _scores(q, k, causal, scale, lengths, mask) -> torch.Tensor:
    """q kᵀ · scale + mask with every hidden key at -inf, in q's dtype: [B, H, S_q, S_k]."""
    h, hk = q.shape[1], k.shape[1]
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    keep = (keep.tril() if causal else keep)[None, None]
    if lengths is not None:
        keys = torch.arange(sk, device=q.device)
        keep = keep & (keys[None, :] < lengths.to(q.device)[:, None])[:, None, None, :]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask.to(s.dtype)
    return s.masked_fill(~keep, float("-inf"))


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same function in PyTorch (SDPA's math, in q's dtype; float64 in the tests)."""
    if k.shape[1] != q.shape[1]:
        v = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    p = torch.softmax(_scores(q, k, causal, scale, lengths, mask), dim=-1)
    return p.nan_to_num(0.0) @ v  # a row that sees no key: 0, as SDPA's math


def _takes(q, k, v, mask) -> bool:
    return runs_triton(q) and unsupported(q, k, v, mask) is None


def reference_backward(do, q, k, v, causal, scale, lengths=None, mask=None):
    """(dq, dk, dv) of `reference` in closed form (the op's body runs below autograd, so
    it cannot differentiate the reference): dV = Pᵀ dO, dS = P ∘ (dO vᵀ - rowsum(dO ∘ O)),
    dQ = dS k · scale, dK = dSᵀ q · scale, summed over a kv head's query heads."""
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(g, dim=1) if g != 1 else t for t in (k, v))
    p = torch.softmax(_scores(q, k, causal, scale, lengths, mask), -1).nan_to_num(0.0)
    do = do.to(q.dtype)
    dv = p.transpose(-1, -2) @ do
    dp = do @ vv.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = ds @ kk * scale
    dk = ds.transpose(-1, -2) @ q * scale
    if g != 1:
        dk, dv = (t.unflatten(1, (k.shape[1], g)).sum(2) for t in (dk, dv))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _reference_lse(q, k, causal, scale, lengths, mask) -> torch.Tensor:
    """The rows' log-sum-exp in fp32 (0 for a row that sees no key, as the kernel's)."""
    lse = _scores(q.float(), k.float(), causal, scale, lengths, mask).logsumexp(-1)
    return lse.masked_fill(torch.isinf(lse), 0.0)


@triton_op("opswap::flash_attention", mutates_args=())
def _flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    lengths: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention of q [B, H, S_q, D] over k, v [B, H_kv, S_k, D], lse [B, H, S_q] fp32)."""
    if _takes(q, k, v, mask):
        return triton_forward(q, k, v, causal, scale, lengths, mask)
    o = reference(q, k, v, causal, scale, lengths, mask).to(q.dtype).contiguous()
    return o, _reference_lse(q, k, causal, scale, lengths, mask)


@triton_op("opswap::flash_attention_backward", mutates_args=())
def _flash_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    lengths: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of opswap::flash_attention's output."""
    if _takes(q, k, v, mask):
        return triton_backward(do, q, k, v, o, lse, causal, scale, lengths, mask)
    return reference_backward(do, q, k, v, causal, scale, lengths, mask)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, v, causal, scale, lengths, mask = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, lengths, mask)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, do: torch.Tensor, dlse: torch.Tensor | None):
    q, k, v, o, lse, lengths, mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.opswap.flash_attention_backward(
        do, q, k, v, o, lse, ctx.causal, ctx.scale, lengths, mask
    )
    return dq, dk, dv, None, None, None, None


_flash_attention.register_autograd(_backward, setup_context=_setup)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """`opswap::flash_attention`'s output: softmax(q kᵀ · scale + mask) v with the module
    docstring's masks; `scale` defaults to 1/sqrt(head_dim), as in SDPA. `key_padding`
    (bool [B, S_k], True for a real key) is BERT's padding mask, read as [B, 1, 1, S_k]."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if key_padding is not None:
        kp = key_padding.to(torch.bool)[:, None, None, :]
        if mask is None:
            mask = kp
        elif mask.dtype == torch.bool:
            mask = mask & kp
        else:
            mask = mask.masked_fill(~kp, float("-inf"))
    return torch.ops.opswap.flash_attention(q, k, v, causal, s, lengths, mask)[0]


def sdpa(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """PyTorch's scaled_dot_product_attention with GQA expanded (the benchmark's peer)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
