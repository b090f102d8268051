"""Attention over a paged KV cache (chapter 29): decode (one query token per sequence) and
chunked prefill (a chunk of each sequence's prompt against everything cached before it).

The cache is a pool of fixed-size blocks shared by every sequence, as serving engines
keep it: `k_cache` and `v_cache` are [num_blocks, block_size, kv_heads, head_dim], and a
sequence's tokens lie in the blocks its row of `block_tables` lists, in order (token t of
sequence s at block `block_tables[s, t // block_size]`, slot `t % block_size`). Queries
have `heads` heads, a multiple of `kv_heads` (grouped-query attention: query head h reads
KV head h // (heads // kv_heads)).

This module holds the PyTorch reference of both, which the CPU engine runs and the
kernels are tested against; the public functions pick the kernel for the tensors' device.
"""

from __future__ import annotations

import torch


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(heads per KV head, block size), after checking the shapes agree."""
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    heads, d = q.shape[-2], q.shape[-1]
    kv_heads = k_cache.shape[2]
    if d != k_cache.shape[3] or heads % kv_heads:
        raise ValueError(
            f"queries of {heads} heads of size {d} cannot read a cache of {kv_heads} KV heads "
            f"of size {k_cache.shape[3]}: heads must be a multiple of KV heads, sizes equal"
        )
    return heads // kv_heads, k_cache.shape[1]


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, group: int
) -> torch.Tensor:
    """One sequence's first `length` cached tokens as [heads, length, head_dim] (each KV
    head repeated `group` times for its query heads)."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    kv = cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:length]
    return kv.transpose(0, 1).repeat_interleave(group, dim=0)


def reference_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, head_dim], one token per sequence, attending to the sequence's
    `context_lens[b]` cached tokens (its own included: written before the call); returns
    [B, heads, head_dim] in q's dtype, computed in float32."""
    group, _ = _check(q, k_cache, v_cache)
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        k = gather_kv(k_cache, block_tables[b], length, group).float()
        v = gather_kv(v_cache, block_tables[b], length, group).float()
        scores = torch.einsum("hd,hld->hl", q[b].float(), k) * scale
        out[b] = torch.einsum("hl,hld->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def reference_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, head_dim]: the chunks of S sequences packed one after another, sequence
    s's chunk at rows cu_q_lens[s]:cu_q_lens[s + 1]. Its cache already holds the chunk's own
    keys and values, `context_lens[s]` tokens in all, so the chunk's query i sits at
    position context_lens[s] - chunk + i and attends causally to every position up to its
    own. Returns [T, heads, head_dim] in q's dtype, computed in float32."""
    group, _ = _check(q, k_cache, v_cache)
    out = torch.empty_like(q)
    starts, lengths = cu_q_lens.tolist(), context_lens.tolist()
    for s, length in enumerate(lengths):
        a, b = starts[s], starts[s + 1]
        chunk = b - a
        if chunk == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], length, group).float()
        v = gather_kv(v_cache, block_tables[s], length, group).float()
        scores = torch.einsum("thd,hld->htl", q[a:b].float(), k) * scale
        pos = torch.arange(length - chunk, length, device=q.device)
        hidden = torch.arange(length, device=q.device)[None, :] > pos[:, None]
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[a:b] = torch.einsum("htl,hld->thd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over the paged cache (see `reference_decode` for the contract)."""
    return reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Chunked-prefill attention over the paged cache (see `reference_prefill`)."""
    return reference_prefill(q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale)
