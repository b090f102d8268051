"""GPT-2 on the serving engine's paged KV cache (chapter 29).

GPT-2's layout differs from Llama's in every piece the runner owns: learned absolute
position embeddings added to the token embeddings (no rotation of q and k), LayerNorm
with a bias before attention and MLP, one fused `c_attn` projection to q, k and v stored
as a `Conv1D` (weight [in, out], so y = x W + b; transposed once here into F.linear's
[out, in]), full multi-head attention (as many KV heads as heads), a GELU-tanh MLP, a final
LayerNorm, and an LM head tied to the token embeddings. The attention itself is the
engine's, over the same paged cache as Llama's runner.

Refused in one sentence: cross-attention layers, attention scaled by the inverse layer
index, and activations other than GELU (exact or tanh) and ReLU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from opswap.llm.hf_decoder import linear
from opswap.llm.quant import Weight
from opswap.llm.runner import Attend, RunnerError, register_runner


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation, op for op, so that float32 logits match its own
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": _gelu_new,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass
class _Block:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    wqkv: Weight  # [3 hidden, hidden]: q over k over v
    bqkv: torch.Tensor
    wo: Weight
    bo: torch.Tensor
    wfc: Weight
    bfc: torch.Tensor
    wproj: Weight
    bproj: torch.Tensor


def gpt2_refusal(model: Any) -> str | None:
    """Why GPT2Runner cannot run the model, or None when it can."""
    c = model.config
    if getattr(c, "add_cross_attention", False):
        return (
            "a GPT-2 with cross-attention layers is not supported; the engine runs decoders only."
        )
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        return "GPT-2 attention scaled by the inverse layer index is not supported."
    act = getattr(c, "activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        return (
            f"the model's MLP activation '{act}' is not supported; GPT-2's runner takes "
            f"{', '.join(_ACTIVATIONS)}."
        )
    return None


@register_runner("GPT2LMHeadModel")
class GPT2Runner:
    """GPT-2's weights, read once into plain tensors, and its layer math over packed tokens."""

    def __init__(
        self, model: Any, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        why = gpt2_refusal(model)
        if why is not None:
            raise RunnerError(why)
        c = model.config
        if max_len > c.n_positions:
            raise RunnerError(
                f"max_model_len {max_len} is longer than GPT-2's {c.n_positions} learned "
                f"positions; use max_model_len <= {c.n_positions}."
            )
        self.device, self.dtype = torch.device(device), dtype
        self.heads = self.kv_heads = int(c.n_head)
        self.head_dim = int(c.n_embd) // self.heads
        self.scale = self.head_dim**-0.5 if getattr(c, "scale_attn_weights", True) else 1.0
        self.vocab = int(c.vocab_size)
        self.eps = float(c.layer_norm_epsilon)
        self.act = _ACTIVATIONS[getattr(c, "activation_function", "gelu_new")]

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(self.device, dtype)

        def conv(m: Any) -> tuple[torch.Tensor, torch.Tensor]:
            # Conv1D keeps [in, out]; F.linear wants [out, in]
            return own(m.weight).t().contiguous(), own(m.bias)

        body = model.transformer
        self.blocks: list[_Block] = []
        for b in body.h:
            wqkv, bqkv = conv(b.attn.c_attn)
            wo, bo = conv(b.attn.c_proj)
            wfc, bfc = conv(b.mlp.c_fc)
            wproj, bproj = conv(b.mlp.c_proj)
            self.blocks.append(
                _Block(
                    own(b.ln_1.weight),
                    own(b.ln_1.bias),
                    own(b.ln_2.weight),
                    own(b.ln_2.bias),
                    wqkv,
                    bqkv,
                    wo,
                    bo,
                    wfc,
                    bfc,
                    wproj,
                    bproj,
                )  # fmt: skip
            )
        self.num_layers = len(self.blocks)
        self.wte, self.wpe = own(body.wte.weight), own(body.wpe.weight)
        self.lnf_w, self.lnf_b = own(body.ln_f.weight), own(body.ln_f.bias)
        self.lm_head: Weight = own(model.lm_head.weight)  # tied to wte in GPT-2, read all the same

    def projections(self) -> list[tuple[object, str]]:
        """(holder, attribute) of every block's Linear weights, for llm.quant."""
        names = ("wqkv", "wo", "wfc", "wproj")
        return [(b, n) for b in self.blocks for n in names]

    def head(self) -> tuple[object, str]:
        return self, "lm_head"

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte[ids] + self.wpe[positions]

    def _ln(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)

    def layer(
        self, i: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        b, t = self.blocks[i], x.shape[0]
        h = self._ln(x, b.ln1_w, b.ln1_b)
        q, k, v = linear(h, b.wqkv, b.bqkv).view(t, 3, self.heads, self.head_dim).unbind(1)
        o = attend(i, q, k, v)  # [T, H, D]
        x = x + linear(o.reshape(t, -1), b.wo, b.bo)
        h = self._ln(x, b.ln2_w, b.ln2_b)
        return x + linear(self.act(linear(h, b.wfc, b.bfc)), b.wproj, b.bproj)

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        h = self._ln(x if rows is None else x[rows], self.lnf_w, self.lnf_b)
        return linear(h, self.lm_head, None)
