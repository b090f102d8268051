"""The layers of a Hugging Face Llama-style causal LM (Llama, Mistral, Qwen2), run with
opswap's static KV cache and `opswap::decode_attention`.

    net = HFDecoder(model, max_len=160, device="cuda", dtype=torch.bfloat16)
    logits = net.prefill(input_ids, cache)      # [B, T, vocab]; fills cache slots 0..T-1
    logits = net.step(tokens, cache)            # tokens [B, 1] -> [B, vocab]; one slot more

The model's weights are read once into plain tensors (the user's modules are neither
changed nor called): q, k and v projections concatenated into one matrix and gate and up
into another (one GEMM each per layer instead of three and two, which matters at batch 1
where every GEMM is a matrix-vector product bound by reading its weights), o and down
projections, the RMSNorm weights with the config's eps, embeddings and the LM head.
The math is Hugging Face's, op for op: RMSNorm in fp32 and the weight applied in the
model's dtype, RoPE from cos/sin tables in the model's dtype (`rotate_half`), SiLU-gated
MLP; prefill attention is SDPA, causal, with the GQA groups expanded by SDPA.

`kernels=True` swaps the elementwise work between the GEMMs for opswap's fused ops, the
ones the chapter-10, -9 and -4 rules install: `opswap::add_rms_norm` (each residual add
and the RMSNorm that reads it, one pass; HF's formulation), `opswap::rope` (q and k
rotated in one launch, reading the cos/sin table at the positions), `opswap::glu_packed`
(SiLU(gate) * up from the packed gate|up GEMM). At batch 1 a layer then runs 9 kernels
instead of about 30, which is what a CUDA graph's replay still pays for one by one. The
rotary embedding is then computed in fp32 and rounded once (HF's rounds each product in
the model's dtype), so bf16 logits differ from HF's by a rounding; in fp32 they agree.

RoPE: the default kind, inv_freq = 1 / theta^(2i / head_dim) with the config's rope_theta
(config.rope_parameters in transformers 5, rope_theta and rope_scaling before). Scaled
kinds (linear, dynamic, yarn, llama3, ...) are refused in one sentence, as are
sliding-window attention shorter than the cache, activations other than SiLU and
partial rotary embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from opswap.kernels import rms_norm as _rms_ops  # noqa: F401  (registers the fused ops)
from opswap.kernels import rope as _rope_ops  # noqa: F401
from opswap.kernels import swiglu as _glu_ops  # noqa: F401
from opswap.kernels.decode_attention import decode_attention
from opswap.llm.quant import Weight, linear
from opswap.llm.static_cache import DecodeError, StaticKVCache

#: the transformers classes whose layout this module reads
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def rope_kind(config: Any) -> tuple[str, float]:
    """(rope type, theta) of a config, in transformers 5's form or the older one."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return str(params.get("rope_type", params.get("type", "default"))), float(
            params["rope_theta"]
        )
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return str(kind), float(getattr(config, "rope_theta", 10000.0))


def refusal(model: Any, max_len: int) -> str | None:
    """Why HFDecoder cannot run `model` with a cache of max_len, or None when it can."""
    name = type(model).__name__
    if name not in SUPPORTED:
        return (
            f"StaticDecoder runs {', '.join(SUPPORTED)}; {name} has another layout, so "
            "generate with it through transformers instead."
        )
    c = model.config
    kind, _ = rope_kind(c)
    if kind != "default":
        return f"the model's RoPE scaling '{kind}' is not supported; only the default RoPE is."
    if getattr(c, "hidden_act", "silu") != "silu":
        return f"the model's MLP activation '{c.hidden_act}' is not supported; only SiLU is."
    if float(getattr(c, "partial_rotary_factor", 1.0)) != 1.0:
        return "a partial rotary embedding (partial_rotary_factor < 1) is not supported."
    window = getattr(c, "sliding_window", None)
    sliding = any(t != "full_attention" for t in (getattr(c, "layer_types", None) or []))
    if name == "Qwen2ForCausalLM":
        sliding = sliding or bool(getattr(c, "use_sliding_window", False))
    elif window is not None and window < max_len:
        sliding = True
    if sliding and (window is None or window < max_len):
        return (
            f"the model attends through a sliding window of {window} keys, shorter than "
            f"max_len {max_len}; use max_len <= {window} or transformers' generate."
        )
    return None


@dataclass
class _Layer:
    """One decoder layer's weights, packed for the device and dtype of the run."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps1: float
    eps2: float
    wqkv: Weight  # [(H + 2 H_kv) D, hidden]
    bqkv: torch.Tensor | None
    wo: Weight
    bo: torch.Tensor | None
    wgu: Weight  # [2 I, hidden]: gate over up
    bgu: torch.Tensor | None
    wdown: Weight
    bdown: torch.Tensor | None


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class HFDecoder:
    """A Llama-style model's layers over a StaticKVCache: `prefill` and one-token `step`."""

    def __init__(
        self,
        model: Any,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        kernels: bool = False,
    ) -> None:
        why = refusal(model, max_len)
        if why is not None:
            raise DecodeError(why)
        c = model.config
        self.kernels = bool(kernels)
        self.device, self.dtype = torch.device(device), dtype
        self.heads = int(c.num_attention_heads)
        self.kv_heads = int(getattr(c, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // self.heads)
        self.scale = self.head_dim**-0.5
        self.vocab = int(c.vocab_size)
        _, self.theta = rope_kind(c)

        def own(t: torch.Tensor) -> torch.Tensor:
            # .to() may hand back the model's own tensor: it is only ever read here
            return t.detach().to(self.device, dtype)

        def own_bias(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else own(t)

        def cat(*mods: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = torch.cat([m.weight.detach() for m in mods]).to(self.device, dtype)
            biases = [m.bias for m in mods]
            if all(b is None for b in biases):
                return w, None
            parts = [
                b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0])
                for m, b in zip(mods, biases, strict=True)
            ]
            return w, torch.cat(parts).to(self.device, dtype)

        body = model.model
        self.layers: list[_Layer] = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            wqkv, bqkv = cat(a.q_proj, a.k_proj, a.v_proj)
            wgu, bgu = cat(m.gate_proj, m.up_proj)
            self.layers.append(
                _Layer(
                    ln1=own(layer.input_layernorm.weight),
                    ln2=own(layer.post_attention_layernorm.weight),
                    eps1=float(layer.input_layernorm.variance_epsilon),
                    eps2=float(layer.post_attention_layernorm.variance_epsilon),
                    wqkv=wqkv,
                    bqkv=bqkv,
                    wo=own(a.o_proj.weight),
                    bo=own_bias(a.o_proj.bias),
                    wgu=wgu,
                    bgu=bgu,
                    wdown=own(m.down_proj.weight),
                    bdown=own_bias(m.down_proj.bias),
                )
            )
        self.embed = own(body.embed_tokens.weight)
        self.norm = own(body.norm.weight)
        self.norm_eps = float(body.norm.variance_epsilon)
        self.lm_head: Weight = own(model.lm_head.weight)
        self.lm_bias = own_bias(getattr(model.lm_head, "bias", None))
        self.cos, self.sin = self.rope_tables(max_len)

    def projections(self) -> list[tuple[object, str]]:
        """(holder, attribute) of every layer's Linear weights, for llm.quant."""
        names = ("wqkv", "wo", "wgu", "wdown")
        return [(layer, n) for layer in self.layers for n in names]

    def head(self) -> tuple[object, str]:
        return self, "lm_head"

    def rope_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_len, head_dim] in the run's dtype, computed in fp32 as HF does."""
        d = self.head_dim
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float().to(self.device) / d)
        )
        pos = torch.arange(max_len, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        return StaticKVCache(
            len(self.layers), batch, self.kv_heads, max_len, self.head_dim,
            device=self.device, dtype=self.dtype,
        )  # fmt: skip

    def qkv(self, x: torch.Tensor, layer: _Layer, positions: torch.Tensor) -> tuple:
        """q [B, H, T, D], k, v [B, H_kv, T, D] of x [B, T, hidden], RoPE at positions."""
        b, t, _ = x.shape
        d, h, hk = self.head_dim, self.heads, self.kv_heads
        qkv = linear(x, layer.wqkv, layer.bqkv)
        q, k, v = qkv.split((h * d, hk * d, hk * d), -1)
        q = q.view(b, t, h, d).transpose(1, 2)
        k = k.view(b, t, hk, d).transpose(1, 2)
        v = v.view(b, t, hk, d).transpose(1, 2)
        if self.kernels:
            q, k = torch.ops.opswap.rope(q, k, self.cos, self.sin, positions, False)
            return q, k, v
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, T, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        gu = linear(x, layer.wgu, layer.bgu)
        if self.kernels:
            return linear(torch.ops.opswap.glu_packed(gu, "silu"), layer.wdown, layer.bdown)
        gate, up = gu.chunk(2, -1)
        return linear(F.silu(gate) * up, layer.wdown, layer.bdown)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels:
            return torch.ops.opswap.rms_norm(x, w, eps, 0.0, True)
        return _rms_norm(x, w, eps)

    def add_rms_norm(
        self, a: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + a), x + a): the residual stream and the next sublayer's input."""
        if self.kernels:
            return torch.ops.opswap.add_rms_norm(a, x, w, eps, 0.0, True)
        s = x + a
        return _rms_norm(s, w, eps), s

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, attend):
        """Logits of hidden states x [B, T, hidden] at positions [B, T] through every
        layer, writing each layer's k, v into the cache; attend(i, q, k, v) -> o."""
        layers = self.layers
        b, t, _ = x.shape
        h = self.rms_norm(x, layers[0].ln1, layers[0].eps1)
        for i, layer in enumerate(layers):
            q, k, v = self.qkv(h, layer, positions)
            cache.write(i, k, v, positions)
            o = attend(i, q, k, v)
            a = linear(o.transpose(1, 2).reshape(b, t, -1), layer.wo, layer.bo)
            h, x = self.add_rms_norm(a, x, layer.ln2, layer.eps2)
            m = self.mlp(h, layer)
            w, eps = (
                (layers[i + 1].ln1, layers[i + 1].eps1)
                if i + 1 < len(layers)
                else (self.norm, self.norm_eps)
            )
            h, x = self.add_rms_norm(m, x, w, eps)
        return linear(h, self.lm_head, self.lm_bias)

    def prefill(
        self, input_ids: torch.Tensor, cache: StaticKVCache, causal: Any = None
    ) -> torch.Tensor:
        """Logits [B, T, vocab] of a prompt [B, T] into an empty cache, which then holds
        its T keys and values per layer (lengths = T). `causal(q, k, v, scale)` is the
        attention (default: SDPA, causal)."""
        t = input_ids.shape[1]
        gqa = self.kv_heads != self.heads

        def attend(i, q, k, v):
            if causal is not None:
                return causal(q, k, v, self.scale)
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa
            )

        logits = self._layers(self.embed[input_ids], cache.positions(t), cache, attend)
        cache.advance(t)
        return logits

    def step(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """Logits [B, vocab] of one token per sequence (tokens [B, 1]) at each sequence's
        next slot; the cache gains the token (lengths + 1). Nothing here depends on a
        Python value that changes per step: the step can be captured as a CUDA graph."""
        positions = cache.lengths.to(torch.int64)[:, None]  # [B, 1]
        lengths = cache.lengths + 1  # the keys each query sees, itself included

        def attend(i, q, k, v):
            return decode_attention(q, cache.k[i], cache.v[i], lengths, self.scale)

        logits = self._layers(self.embed[tokens], positions, cache, attend)
        cache.lengths.copy_(lengths)
        return logits[:, 0]
