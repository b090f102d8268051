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
- attention is one `scaled_dot_product_attention` with `enable_gqa` (the GQA groups read
  from the kv heads, not copied out), not opswap's Triton op, whose CPU fallback is a
  float32 reference that expands the kv heads and masks the whole cache;
- RoPE rotates q and k in one pass (they sit side by side in the packed qkv output) with
  cos and sin sliced once per step, not gathered per layer; RMSNorm is `F.rms_norm`
  (one op; in float32 it computes what HF's six do, up to the order of a sum); the MLP
  gate is `silu(gate).mul_(up)` in place.

The math is otherwise HF's, op for op (rotate_half, the residual adds, the dtype
casts), so greedy tokens match `generate(do_sample=False)`. Every sequence of the batch
sits at the same position (StaticDecoder prefills equal-length prompts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opswap.llm.hf_decoder import HFDecoder, _Layer
from opswap.llm.static_cache import StaticKVCache


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    # HF rounds the normalised activations to the model's dtype before the weight
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin of qk [B, T, heads, D] (q and k heads together)."""
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), -1)
    return (qk * cos).add_(rotated * sin)


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
    """Attention output of h [B, T, hidden] (normed), T tokens at slots pos.., after o_proj."""
    b, t, _ = h.shape
    d, nh, nk = net.head_dim, net.heads, net.kv_heads
    qkv = F.linear(h, layer.wqkv, layer.bqkv).view(b, t, nh + 2 * nk, d)
    qk = _rope(qkv[:, :, : nh + nk], cos, sin)
    q = qk[:, :, :nh].transpose(1, 2)  # [B, H, T, D]
    k_cache[:, :, pos : pos + t].copy_(qk[:, :, nh:].transpose(1, 2))
    v_cache[:, :, pos : pos + t].copy_(qkv[:, :, nh + nk :].transpose(1, 2))
    end = pos + t
    o = F.scaled_dot_product_attention(
        q, k_cache[:, :, :end], v_cache[:, :, :end], scale=net.scale, enable_gqa=nh != nk
    )
    return F.linear(o.transpose(1, 2).reshape(b, t, nh * d), layer.wo, layer.bo)


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
        gate, up = F.linear(h, layer.wgu, layer.bgu).chunk(2, -1)
        x = x + F.linear(F.silu(gate).mul_(up), layer.wdown, layer.bdown)
        if i + 1 < len(layers):
            h = _norm(x, layers[i + 1].ln1, layers[i + 1].eps1)
        else:
            h = _norm(x, net.norm, net.norm_eps)
    return F.linear(h, net.lm_head, net.lm_bias).view(b, -1)
