"""Attention over a paged KV cache (chapter 29): decode (one query token per sequence) and
chunked prefill (a chunk of each sequence's prompt against everything cached before it).

The cache is a pool of fixed-size blocks shared by every sequence, as serving engines
keep it: `k_cache` and `v_cache` are [num_blocks, block_size, kv_heads, head_dim], and a
sequence's tokens lie in the blocks its row of `block_tables` lists, in order (token t of
sequence s at block `block_tables[s, t // block_size]`, slot `t % block_size`). Queries
have `heads` heads, a multiple of `kv_heads` (grouped-query attention: query head h reads
KV head h // (heads // kv_heads)).

This module holds the PyTorch reference of both, which the CPU engine runs and the
kernels are tested against, the Triton kernels (ops `opswap::paged_decode_attention` and
`opswap::paged_prefill_attention`), and the public functions, which run the ops on CUDA
tensors (and on CPU tensors under TRITON_INTERPRET=1, as the tests do) and the reference
otherwise.

Why these kernels. A decode step reads each sequence's keys and values once and does two
small products per key: it is memory-bound, and what counts is that every byte of the
cache is read once and that enough programs pull the bytes. The decode kernel is the
split-K ("flash-decoding") kernel of `decode_attention` with one change, where a key's
bytes come from: key t of sequence b is at block `block_tables[b, t // block_size]`, slot
`t % block_size` (one table load per key, from a row that stays in L1), so any block size
works and the blocks need not be contiguous. One program per (sequence, KV head, split)
holds the GROUP query heads of its KV head as one [GROUP padded to 16, D] tile, so GQA's
keys and values are read once for the group, not GROUP times; a combine kernel merges the
splits by their log-sum-exp. The prefill kernel is FlashAttention's forward over the same
gathered keys: one program per (sequence, tile of the chunk's queries, head), reading
keys only up to the tile's last causal position. Both keep the softmax in float32 (online,
in the exp2 domain) and write q's dtype. Head dims up to 256 (non-powers of two through a
masked, padded tile); fp16, bf16 and fp32. Inference only: a gradient raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.library import wrap_triton

from opswap.kernels._paged_triton import _paged_combine_fn, _paged_decode_fn, _paged_prefill_fn
from opswap.kernels._rows import (
    KernelError,
    _is_fake,
    interpreting,
    jitted,
    rn_flag,
    runs_triton,
    triton,
)
from opswap.kernels._triton_op import triton_op
from opswap.kernels.decode_attention import INTERP_BLOCK_N, LOG2E, plan_splits

#: the largest head dim the kernels hold in one tile
MAX_HEAD_DIM = 256
#: query rows per prefill program (a multiple of every BLOCK_N below): GPU, interpreter
PREFILL_BLOCK_M = 64
INTERP_BLOCK_M = 16
#: (BLOCK_N, num_warps, num_stages) the kernels are autotuned over on a GPU; the decode
#: kernel's are pruned to BLOCK_N <= its split length (a multiple of 64)
DECODE_CONFIGS = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3))
PREFILL_CONFIGS = ((32, 4, 2), (64, 4, 2), (64, 8, 2), (32, 4, 3))


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


_KERNELS: dict[tuple[str, bool], Any] = {}


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    split = int({**named_args, **kwargs}["SPLIT_LEN"])
    keep = [c for c in configs if c.kwargs["BLOCK_N"] <= split]
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_N"])]


def _kernel(name: str) -> Any:
    """The decode split kernel, the combine or the prefill kernel; on a GPU the first and
    the last autotuned over their configs."""
    key = (name, interpreting())
    if key not in _KERNELS:
        fns: dict[str, Callable[..., Any]] = {
            "decode": _paged_decode_fn,
            "combine": _paged_combine_fn,
            "prefill": _paged_prefill_fn,
        }
        k = jitted(fns[name])
        if name != "combine" and not interpreting():
            table = DECODE_CONFIGS if name == "decode" else PREFILL_CONFIGS
            configs = [
                triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in table
            ]
            if name == "decode":
                k = triton.autotune(
                    configs,
                    key=["SPLIT_LEN", "BLOCK_D", "BLOCK_G", "DIRECT"],
                    prune_configs_by={"early_config_prune": _prune},
                )(k)
            else:
                k = triton.autotune(configs, key=["BLOCK_D", "GROUP"])(k)
        _KERNELS[key] = k
    return _KERNELS[key]


def unsupported(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
) -> str | None:
    """Why the kernels cannot take these tensors (the reference then runs), or None."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (
        q.dtype == k_cache.dtype == v_cache.dtype
    ):
        return f"dtypes {q.dtype}, {k_cache.dtype}, {v_cache.dtype}: the kernels take one of fp16, bf16, fp32"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]}: the kernels take at most {MAX_HEAD_DIM}"
    ints = (torch.int32, torch.int64)
    if block_tables.dim() != 2 or block_tables.dtype not in ints or lens.dtype not in ints:
        return "block tables must be an integer [sequences, max_blocks] tensor and lengths integer"
    if not (k_cache.device == v_cache.device == block_tables.device == q.device):
        return "the caches and block tables must be on the queries' device"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "the caches' head dim must be contiguous"
    return None


def _common(q: torch.Tensor) -> dict[str, Any]:
    """The constexprs both kernels take."""
    d = q.shape[-1]
    return {
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "PREC": "ieee" if q.dtype == torch.float32 else "tf32",
        "DOT_F32": interpreting(),
    }


def triton_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    splits: int = 0,
) -> torch.Tensor:
    """[B, H, D] (q's dtype) by the split and combine kernels; `splits` > 0 asks for that
    many (tests), 0 lets `plan_splits` choose from the table's width and the GPU."""
    group, bs = _check(q, k_cache, v_cache)
    q = q if q.stride(-1) == 1 else q.contiguous()
    bsz, h, d = q.shape
    hk = k_cache.shape[2]
    s_max = block_tables.shape[1] * bs
    n_splits, split_len = plan_splits(bsz, hk, s_max, q.device, splits)
    out = q.new_empty(q.shape)  # contiguous, whatever q's strides
    if out.numel() == 0:
        return out
    kw = _common(q)
    direct = n_splits == 1  # the split kernel writes the output: no partials, no combine
    parts = 1 if direct else bsz * h * n_splits
    o_part = q.new_empty((parts, kw["BLOCK_D"]), dtype=torch.float32)
    lse = q.new_empty((parts,), dtype=torch.float32)
    lens = context_lens.to(q.device)
    if interpreting():
        kw.update(BLOCK_N=INTERP_BLOCK_N)
    wrap_triton(_kernel("decode"))[(bsz * hk, n_splits)](
        q, k_cache, v_cache, block_tables, lens, o_part, lse, out, out.stride(0), out.stride(1),
        scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        hk, group, bs, s_max, split_len, n_splits, d,
        BLOCK_G=max(16, triton.next_power_of_2(group)), DIRECT=direct, RN=rn_flag(q.dtype), **kw,
    )  # fmt: skip
    if direct:
        return out
    wrap_triton(_kernel("combine"))[(bsz * h,)](
        o_part, lse, lens, out, out.stride(0), out.stride(1), h, s_max, split_len, n_splits, d,
        BLOCK_D=kw["BLOCK_D"], BLOCK_S=max(2, triton.next_power_of_2(n_splits)), RN=rn_flag(q.dtype),
    )  # fmt: skip
    return out


def triton_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[T, H, D] (q's dtype) by the prefill kernel. The tile map is built on the device
    (no host sync): the grid is a bound on the tile count, cdiv(T, BLOCK_M) + S."""
    group, bs = _check(q, k_cache, v_cache)
    q = q if q.stride(-1) == 1 else q.contiguous()
    t, h, d = q.shape
    n_seq = context_lens.shape[0]
    out = q.new_empty(q.shape)  # contiguous, whatever q's strides
    if out.numel() == 0 or n_seq == 0:
        return out
    block_m = INTERP_BLOCK_M if interpreting() else PREFILL_BLOCK_M
    cu = cu_q_lens.to(device=q.device, dtype=torch.int32)
    per_seq = (cu[1:] - cu[:-1] + block_m - 1) // block_m
    tiles = torch.cat([cu.new_zeros(1), per_seq.cumsum(0, dtype=torch.int32)])
    kw = _common(q)
    if interpreting():
        kw.update(BLOCK_N=INTERP_BLOCK_N)
    grid = ((t + block_m - 1) // block_m + n_seq, h)
    wrap_triton(_kernel("prefill"))[grid](
        q, k_cache, v_cache, block_tables, cu, context_lens.to(q.device), tiles, out,
        scale * LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), n_seq, group, bs, d,
        STEPS=max(9, n_seq.bit_length()), BLOCK_M=block_m, RN=rn_flag(q.dtype), **kw,
    )  # fmt: skip
    return out


def _kernels_take(q: torch.Tensor, *rest: torch.Tensor) -> bool:
    return runs_triton(q) and unsupported(q, *rest) is None


@triton_op("opswap::paged_decode_attention", mutates_args=())
def _paged_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over the paged cache (`reference_decode`'s contract), returned
    contiguous; the fake kernel, which is this function on fake tensors, gives the same."""
    if _kernels_take(q, k_cache, v_cache, block_tables, context_lens):
        return triton_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    if _is_fake(q):  # the reference reads the lengths on the host: shapes only
        return q.new_empty(q.shape)
    return reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale).contiguous()


@triton_op("opswap::paged_prefill_attention", mutates_args=())
def _paged_prefill_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Chunked-prefill attention over the paged cache (`reference_prefill`'s contract)."""
    if _kernels_take(q, k_cache, v_cache, block_tables, context_lens):
        return triton_paged_prefill(
            q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale
        )
    if _is_fake(q):
        return q.new_empty(q.shape)
    return reference_prefill(
        q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale
    ).contiguous()


def _no_backward(ctx: Any, grad: torch.Tensor) -> None:
    raise KernelError(
        "paged attention is an inference op with no backward; use opswap::flash_attention "
        "or SDPA where a gradient is needed."
    )


for _op in (_paged_decode_op, _paged_prefill_op):
    _op.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over the paged cache (see `reference_decode` for the contract): the
    Triton kernels on CUDA tensors (and CPU ones under TRITON_INTERPRET=1), else the
    reference."""
    _check(q, k_cache, v_cache)
    if _kernels_take(q, k_cache, v_cache, block_tables, context_lens):
        return torch.ops.opswap.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, float(scale)
        )
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
    """Chunked-prefill attention over the paged cache (see `reference_prefill`): the Triton
    kernel where `paged_decode_attention` runs its kernels, else the reference."""
    _check(q, k_cache, v_cache)
    if _kernels_take(q, k_cache, v_cache, block_tables, context_lens):
        return torch.ops.opswap.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, float(scale)
        )
    return reference_prefill(q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale)
