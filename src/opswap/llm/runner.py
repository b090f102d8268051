"""What the serving engine needs from a model (chapter 29): a `ModelRunner`, and the
registry that picks one from the model's class.

    runner = make_runner(model, max_len=2048, device="cuda", dtype=torch.bfloat16)
    x = runner.embed(ids, positions)                    # [T] -> [T, hidden]
    for i in range(runner.num_layers):
        x = runner.layer(i, x, positions, attend)       # attend(i, q, k, v) -> o
    logits = runner.logits(x, rows)                     # [len(rows), vocab]

The engine owns the paged KV cache and the attention over it; a runner owns the weights
and the rest of the layer math. Inside `layer`, the runner hands `attend` the layer's
queries [T, H, D] and keys and values [T, H_kv, D] (rotated, for rotary models) of the
packed tokens and gets the attention output [T, H, D] back; the engine's `attend` writes
the keys and values to their cache slots and runs the paged attention. The cache geometry
the engine allocates comes from the runner: `num_layers`, `kv_heads`, `head_dim`, `dtype`.

A runner class registers the transformers classes it reads with `@register_runner(...)`;
`make_runner` looks the model's class name up and refuses others in one sentence naming
those it runs. `LlamaRunner` (Llama, Mistral, Qwen2) is `HFDecoder`'s weights and layer
functions; `opswap.llm.gpt2_runner.GPT2Runner` is GPT-2's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from opswap.errors import OpswapError
from opswap.llm.hf_decoder import SUPPORTED as LLAMA_LIKE
from opswap.llm.hf_decoder import HFDecoder, linear

#: attend(layer index, q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]) -> o [T, H, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RunnerError(OpswapError, ValueError):
    """A model the engine has no runner for."""


class ModelRunner(Protocol):
    """A causal LM's math over packed tokens, attention left to the caller."""

    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # the attention's softmax scale
    vocab: int
    device: torch.device
    dtype: torch.dtype

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream [T, hidden] of token ids [T] at positions [T]."""
        ...

    def layer(
        self, i: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Layer i over the stream x [T, hidden]; attention through `attend`."""
        ...

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Logits [R, vocab] of the stream's rows `rows` (every row when None)."""
        ...


RunnerFactory = Callable[[Any, int, torch.device | str, torch.dtype], ModelRunner]

#: transformers class name -> the runner class that reads it
RUNNERS: dict[str, RunnerFactory] = {}


def register_runner(*class_names: str) -> Callable[[type], type]:
    """Class decorator: the runner reads models of these transformers classes."""

    def add(cls: type) -> type:
        for name in class_names:
            RUNNERS[name] = cls
        return cls

    return add


def supported_models() -> tuple[str, ...]:
    _load_builtin()
    return tuple(RUNNERS)


def make_runner(
    model: Any, max_len: int, device: torch.device | str, dtype: torch.dtype
) -> ModelRunner:
    """The registered runner for the model's class, reading its weights once."""
    _load_builtin()
    name = type(model).__name__
    factory = RUNNERS.get(name)
    if factory is None:
        raise RunnerError(
            f"LLMEngine runs {', '.join(RUNNERS)}; {name} has another layout, which the "
            "engine does not run yet."
        )
    return factory(model, max_len, device, dtype)


def run_model(
    runner: ModelRunner,
    ids: torch.Tensor,
    positions: torch.Tensor,
    attend: Attend,
    rows: torch.Tensor | None,
) -> torch.Tensor:
    """Embed, every layer, logits of `rows`: one forward over packed tokens."""
    x = runner.embed(ids, positions)
    for i in range(runner.num_layers):
        x = runner.layer(i, x, positions, attend)
    return runner.logits(x, rows)


#: modules that register runners of their own when imported (this module's LlamaRunner
#: registers itself below); named, not imported at the top, since each imports this one
BUILTIN_RUNNERS = ("opswap.llm.gpt2_runner",)


def _load_builtin() -> None:
    for module in BUILTIN_RUNNERS:
        importlib.import_module(module)


@register_runner(*LLAMA_LIKE)
class LlamaRunner:
    """Llama, Mistral and Qwen2: `HFDecoder`'s packed weights and its layer functions
    (RMSNorm, fused qkv GEMM, RoPE at each token's position, SiLU-gated MLP)."""

    def __init__(
        self, model: Any, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        self.net = net = HFDecoder(model, max_len=max_len, device=device, dtype=dtype)
        self.num_layers = len(net.layers)
        self.heads, self.kv_heads, self.head_dim = net.heads, net.kv_heads, net.head_dim
        self.scale, self.vocab = net.scale, net.vocab
        self.device, self.dtype = net.device, dtype

    def projections(self) -> list[tuple[object, str]]:
        return self.net.projections()

    def head(self) -> tuple[object, str]:
        return self.net.head()

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.net.embed[ids]

    def layer(
        self, i: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        net, layer = self.net, self.net.layers[i]
        t = x.shape[0]
        h = net.rms_norm(x, layer.ln1, layer.eps1)
        q, k, v = net.qkv(h[None], layer, positions[None])  # q [1, H, T, D], k, v [1, H_kv, T, D]
        o = attend(i, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))
        a = linear(o.reshape(t, -1), layer.wo, layer.bo)
        h, x = net.add_rms_norm(a, x, layer.ln2, layer.eps2)
        return x + net.mlp(h, layer)

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        net = self.net
        h = net.rms_norm(x if rows is None else x[rows], net.norm, net.norm_eps)
        return linear(h, net.lm_head, net.lm_bias)
