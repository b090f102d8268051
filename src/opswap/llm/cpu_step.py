"""The decode step on the CPU: the position as a Python int, plain ATen ops, few of them.

    logits = step_at(net, tokens, cache, pos)   # tokens [B, 1] at slot pos -> [B, vocab]

On a GPU the step must not depend on a host value (a CUDA graph replays it), so it reads
its position from `cache.lengths` on the device, scatters k and v into the cache and
attends with opswap's split-K kernel. On the CPU nothing is replayed and every op is a
call from Python (a few microseconds of dispatch each, and a fork of the thread pool for
the ones ATen runs in parallel), while the arithmetic of a small model's step is tiny. So
this step counts ops. It takes the position as a Python int and works on views:

- the cache write is a `copy_` into the slice at `pos`, not a `scatter_` with a built
  index; the keys attended are the slice `[:pos + 1]`, not all `max_len` slots behind a
  mask, so nothing is spent on empty slots and no mask is built;
- attention over few keys is written out in elementwise ops and sums (the scores, a
  softmax through `exp2`, the weighted values), with the GQA groups read from the kv
  heads, not copied out, a block of (sequence, kv head) rows at a time so that each op
  stays under ATen's grain size (32768 elements): such ops run inline on the calling
  thread, while `scaled_dot_product_attention`, `softmax`, `exp` and `bmm` open a
  parallel region whatever the size, and on a loaded machine that waits for a second
  thread to be scheduled (16-24 ms each on the 2-core development VM at 2 threads;
  chapter 29). Where that would take more than MAX_BLOCKS blocks, the work is real and
  SDPA with `enable_gqa` takes it. Neither is opswap's Triton op, whose CPU fallback is
  a float32 reference that expands the kv heads and masks the whole cache; a prompt's
  causal attention is done the same way, a block of queries at a time;
- RoPE rotates q and k in one pass (they sit side by side in the packed qkv output) with
  cos and sin sliced once per step, not gathered per layer; RMSNorm in float32 is one
  `F.rms_norm` call (ATen's composite of HF's math, not six calls from Python); the MLP
  gate is `silu(gate).mul_(up)` in place.

The math is otherwise HF's, op for op (rotate_half, the residual adds, the dtype
casts), so greedy tokens match `generate(do_sample=False)`. Every sequence of the batch
sits at the same position (StaticDecoder prefills equal-length prompts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from opswap.llm.hf_decoder import HFDecoder, _Layer
from opswap.llm.quant import Weight, linear
from opswap.llm.static_cache import StaticKVCache

#: at::internal::GRAIN_SIZE: ATen splits elementwise work across threads from this size on
GRAIN = 32768
LOG2E = 1.4426950408889634
#: attention that takes more blocks than this goes to SDPA (it is then real work)
MAX_BLOCKS = 8
#: a batch up to this size runs its Linears one row at a time (see _linear)
GEMV_ROWS = 4


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    # HF rounds the normalised activations to the model's dtype before the weight
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear of x [B, 1, in]. For 1 < B <= GEMV_ROWS, one matrix-vector product per row:
    at 2 threads a 2 x 256 by 256 x 1376 product opened a parallel region (about 24 ms on
    the loaded development VM, against 0.06-0.12 ms for one row), at the cost of reading
    the weights once per row. A low-bit weight (llm.quant) runs its own op over every row."""
    n = x.shape[0]
    if not isinstance(w, torch.Tensor):
        return linear(x, w, b)
    if 1 < n <= GEMV_ROWS:
        return torch.cat([F.linear(x[i : i + 1], w, b) for i in range(n)])
    return F.linear(x, w, b)


def _rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin of qk [B, T, heads, D] (q and k heads together)."""
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), -1)
    return (qk * cos).add_(rotated * sin)


def _attend_inline(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """Attention of one query per sequence and head, q [B, H, D], over k, v [B, H_kv, L, D]
    (every key visible) -> [B, 1, H * D], in ops that stay on the calling thread: a block
    of (sequence, kv head) rows at a time under the grain size; None where that takes
    more than MAX_BLOCKS blocks."""
    b, h, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g = h // hk
    rows = GRAIN // (g * n * d)
    if rows < 1 or -(-b * hk // rows) > MAX_BLOCKS:
        return None
    qg = (q * (scale * LOG2E)).view(b * hk, g, 1, d)  # base-2 scores: exp2 below
    kk, vv = k.reshape(b * hk, 1, n, d), v.reshape(b * hk, 1, n, d)
    if rows >= b * hk:  # one block (tested apart: a compiled step then holds for every L)
        return _softmax_block(qg, kk, vv).view(b, 1, h * d)
    blocks = [
        _softmax_block(qg[i : i + rows], kk[i : i + rows], vv[i : i + rows])
        for i in range(0, b * hk, rows)
    ]
    return torch.cat(blocks).view(b, 1, h * d)


def _softmax_block(qg: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
    """softmax2(qg kk^T) vv of qg [R, G, 1, D] (pre-scaled by log2 e) over kk, vv [R, 1, L, D]
    -> [R, G, D]."""
    s = (qg * kk).sum(-1)  # [R, G, L]
    p = (s - s.amax(-1, keepdim=True)).exp2_()
    o = (p.unsqueeze(-1) * vv).sum(-2)  # [R, G, D]
    return o.div_(p.sum(-1, keepdim=True))


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prompt, q [B, H, T, D] over k, v [B, H_kv, T, D] -> [B, H, T, D],
    in the ops of `_attend_inline`, a block of queries at a time so that each op stays
    under the grain size; SDPA where that takes more than MAX_BLOCKS blocks."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    rows = GRAIN // (b * h * t * d)
    if rows < 1 or -(-t // rows) > MAX_BLOCKS:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=h != hk
        )
    qg = (q * (scale * LOG2E)).reshape(b, hk, h // hk, t, 1, d)
    kk, vv = k[:, :, None, None], v[:, :, None, None]  # [B, H_kv, 1, 1, T, D]
    keys = torch.arange(t, device=q.device)
    out = []
    for i in range(0, t, rows):
        j = min(t, i + rows)  # queries i..j-1 see keys 0..j-1
        s = (qg[:, :, :, i:j] * kk[..., :j, :]).sum(-1)  # [B, H_kv, G, j - i, j]
        s = s.masked_fill(keys[None, :j] > keys[i:j, None], float("-inf"))
        p = (s - s.amax(-1, keepdim=True)).exp2_()
        o = (p.unsqueeze(-1) * vv[..., :j, :]).sum(-2)  # [B, H_kv, G, j - i, D]
        out.append(o.div_(p.sum(-1, keepdim=True)))
    return torch.cat(out, 3).view(b, h, t, d)


def _layer(
    net: HFDecoder,
    layer: _Layer,
    h: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Attention output of h [B, 1, hidden] (normed) at slot pos, after o_proj."""
    b = h.shape[0]
    d, nh, nk = net.head_dim, net.heads, net.kv_heads
    qkv = _linear(h, layer.wqkv, layer.bqkv).view(b, 1, nh + 2 * nk, d)
    qk = _rope(qkv[:, :, : nh + nk], cos, sin)
    k_cache[:, :, pos : pos + 1].copy_(qk[:, :, nh:].transpose(1, 2))
    v_cache[:, :, pos : pos + 1].copy_(qkv[:, :, nh + nk :].transpose(1, 2))
    keys, values = k_cache[:, :, : pos + 1], v_cache[:, :, : pos + 1]
    o = _attend_inline(qk[:, 0, :nh], keys, values, net.scale)
    if o is None:
        q = qk[:, :, :nh].transpose(1, 2)  # [B, H, 1, D]
        sdpa = F.scaled_dot_product_attention(q, keys, values, scale=net.scale, enable_gqa=nh != nk)
        o = sdpa.transpose(1, 2).reshape(b, 1, nh * d)
    return _linear(o, layer.wo, layer.bo)


def step_at(net: HFDecoder, tokens: torch.Tensor, cache: StaticKVCache, pos: int) -> torch.Tensor:
    """Logits [B, vocab] of tokens [B, 1] at cache slot `pos` of every sequence; writes
    their keys and values there. `cache.lengths` is left to the caller."""
    layers = net.layers
    b = tokens.shape[0]
    d = net.head_dim
    cos = net.cos[pos : pos + 1].view(1, 1, 1, d)
    sin = net.sin[pos : pos + 1].view(1, 1, 1, d)
    x = F.embedding(tokens, net.embed)  # [B, 1, hidden]
    h = _norm(x, layers[0].ln1, layers[0].eps1)
    for i, layer in enumerate(layers):
        a = _layer(net, layer, h, cache.k[i], cache.v[i], pos, cos, sin)
        x = x + a
        h = _norm(x, layer.ln2, layer.eps2)
        gate, up = _linear(h, layer.wgu, layer.bgu).chunk(2, -1)
        x = x + _linear(F.silu(gate).mul_(up), layer.wdown, layer.bdown)
        if i + 1 < len(layers):
            h = _norm(x, layers[i + 1].ln1, layers[i + 1].eps1)
        else:
            h = _norm(x, net.norm, net.norm_eps)
    return _linear(h, net.lm_head, net.lm_bias).view(b, -1)


def compile_step(backend: bool | str = True) -> Callable[..., torch.Tensor]:
    """`step_at` under torch.compile (`backend` True: Inductor). Inductor's C++ kernels
    split a loop across threads from 512 elements a thread on, and with the position
    dynamic it takes the attention's length for large; here a kernel is split only where
    each thread gets GRAIN elements, as ATen's own elementwise ops are (see above)."""
    if backend is True or backend == "inductor":
        return torch.compile(step_at, options={"cpp.min_chunk_size": GRAIN})
    return torch.compile(step_at, backend=str(backend))
