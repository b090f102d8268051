"""Greedy generation with a static KV cache and one CUDA graph per decode step.

    from opswap.llm import StaticDecoder
    dec = StaticDecoder(model, max_len=160, device="cuda", dtype=torch.bfloat16)
    tokens = dec.generate(input_ids, max_new_tokens=128)   # [B, T + 128], like HF's generate

At batch 1 a decode step of a 1B model reads about 2 GB of weights and does a few hundred
small kernels; on an H200 the bytes take well under a millisecond, and the launches, one
by one from Python, take about as long again. The decoder removes the launches: the
step (embedding, every layer, the LM head, the argmax and the feedback of the chosen
token into the next step's input) is captured once as a CUDA graph and replayed per
token with no host work in between; the KV cache and the token buffers are static, and
positions come from the cache's `lengths` tensor on the device (see static_cache).
`compile=True` runs the step through torch.compile first (fused elementwise work, the
same graph capture around it).

On the CPU nothing is captured, and the step is cpu_step's: the position a Python int,
the cache written by slice, attention over the filled slots in ops that stay on the
calling thread while the work is small, so that a step of a small model costs its GEMVs
and little else (`compile=True` compiles that step). `kernels=True` keeps the step above
on the CPU too (the fused ops' references run there).

The prompt (prefill) runs eagerly: its length varies and it happens once per call.
Not here yet: stopping at an end-of-sequence token (the decoder generates exactly
max_new_tokens), prompts of different lengths in one batch, sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opswap.kernels import _rows
from opswap.llm.cpu_step import causal_attend, compile_step, step_at
from opswap.llm.hf_decoder import HFDecoder
from opswap.llm.quant import WeightQuant, quantize_runner
from opswap.llm.static_cache import DecodeError

#: eager decode steps run on a side stream before the capture (autotuning, compilation)
WARMUP_STEPS = 3


class StaticDecoder:
    """A transformers Llama-style causal LM (LlamaForCausalLM, MistralForCausalLM,
    Qwen2ForCausalLM) run by opswap's static cache and decode attention, greedily.

    `max_len` bounds prompt + new tokens; `batch` is fixed (the graph is captured for
    it); `device` and `dtype` default to the model's; `kernels=True` runs the norms, the
    rotary embedding and the gated MLP as opswap's fused Triton ops (see hf_decoder);
    the default, None, takes them on a CUDA device where Triton is installed (1.42x the
    gpt-fast recipe on the H200 with them, 0.76x without; chapter 29) and leaves HF's
    math elsewhere, where the ops would run their slower references. `weights` ("int8",
    "int4", "fp8" or a WeightQuant) stores the projections low-bit, as LLMEngine's do. On the CPU without
    them the decode loop runs cpu_step (chapter 29 has its figures against HF's generate).
    The user's model is not changed."""

    def __init__(
        self,
        model: Any,
        max_len: int,
        batch: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,
        compile: bool | str = False,
        kernels: bool | None = None,
        weights: str | WeightQuant | None = None,
    ) -> None:
        if int(max_len) < 2 or int(batch) < 1:
            raise DecodeError(
                f"max_len {max_len} and batch {batch}: give max_len >= 2 (prompt and one "
                "new token) and batch >= 1."
            )
        first = next(iter(model.parameters()), None)
        dev = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        dt = dtype or (first.dtype if first is not None else torch.float32)
        if kernels is None:
            kernels = dev.type == "cuda" and _rows.triton is not None
        self.net = HFDecoder(model, int(max_len), dev, dt, kernels=bool(kernels))
        self.weight_stats = quantize_runner(self.net, weights)
        self.max_len, self.batch, self.device, self.dtype = int(max_len), int(batch), dev, dt
        self.cache = self.net.new_cache(self.batch, self.max_len)
        self.cuda_graphs = bool(cuda_graphs) and dev.type == "cuda"
        # on the CPU the step takes its position as a Python int (cpu_step)
        self.host_step = dev.type == "cpu" and not kernels
        # the step's static input and the whole sequence, written on the device
        self._token = torch.zeros(self.batch, 1, dtype=torch.int64, device=dev)
        self._tokens = torch.zeros(self.batch, self.max_len, dtype=torch.int64, device=dev)
        self._step: Callable[[], torch.Tensor] = self._decode
        self._host: Callable[..., torch.Tensor] = step_at
        if compile and self.host_step:
            self._host = compile_step(compile)
        elif compile:
            backend = "inductor" if compile is True else str(compile)
            self._step = torch.compile(self._decode, backend=backend)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_logits: torch.Tensor | None = None

    def _decode(self) -> torch.Tensor:
        """One token per sequence: logits [B, vocab]; the argmax becomes the next input
        and is written into the token buffer at its position."""
        logits = self.net.step(self._token, self.cache)
        nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
        self._token.copy_(nxt)
        self._tokens.scatter_(1, self.cache.lengths.to(torch.int64)[:, None], nxt)
        return logits

    def _capture(self) -> None:
        """Warm the step up on a side stream (Triton autotuning and compilation happen
        there), then capture it; the warm-up's writes are forgotten by the reset that
        every generate starts with."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(WARMUP_STEPS):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.cache.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            self._graph_logits = self._step()
        self._graph = graph

    def _run_step(self) -> torch.Tensor:
        if not self.cuda_graphs:
            return self._step()
        assert self._graph is not None and self._graph_logits is not None
        self._graph.replay()
        return self._graph_logits

    def _check(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise DecodeError(
                "input_ids must be a 2-D tensor of token ids [batch, prompt length]; "
                "tokenize with return_tensors='pt'."
            )
        if input_ids.is_floating_point() or input_ids.is_complex():
            raise DecodeError(f"input_ids are {input_ids.dtype}; pass integer token ids.")
        b, t = input_ids.shape
        if b != self.batch:
            raise DecodeError(
                f"a batch of {b} prompts for a decoder built for batch {self.batch}; "
                f"build StaticDecoder(..., batch={b})."
            )
        if t < 1 or max_new_tokens < 1:
            raise DecodeError(
                f"a prompt of {t} tokens and {max_new_tokens} new ones: give at least one of each."
            )
        if t + max_new_tokens > self.max_len:
            raise DecodeError(
                f"a prompt of {t} tokens plus {max_new_tokens} new ones is longer than "
                f"max_len {self.max_len}; build StaticDecoder with max_len >= {t + max_new_tokens}."
            )
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.net.vocab:
            raise DecodeError(f"input_ids hold ids outside the vocabulary of {self.net.vocab}.")

    @torch.inference_mode()
    def generate_with_logits(
        self, input_ids: torch.Tensor, max_new_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B, T + n], prefill logits [B, T, vocab], the decode steps' logits
        [B, n - 1, vocab]) of greedy generation of n = max_new_tokens tokens."""
        return self._generate(input_ids, max_new_tokens, keep_logits=True)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Prompt and max_new_tokens greedy tokens, [B, T + max_new_tokens] (int64): what
        transformers' `generate(do_sample=False)` returns when no end token stops it."""
        return self._generate(input_ids, max_new_tokens, keep_logits=False)[0]

    def _generate(self, input_ids: torch.Tensor, n: int, keep_logits: bool) -> tuple:
        self._check(input_ids, n)
        if self.cuda_graphs and self._graph is None:
            self._capture()
        ids = input_ids.to(self.device, torch.int64)
        t = ids.shape[1]
        self.cache.reset()
        self._tokens[:, :t].copy_(ids)
        prefill = self.net.prefill(ids, self.cache, causal_attend if self.host_step else None)
        first = prefill[:, -1].argmax(-1, keepdim=True)
        self._token.copy_(first)
        self._tokens[:, t : t + 1].copy_(first)
        if self.host_step:
            return self._generate_host(ids, first, prefill, n, keep_logits)
        steps = []
        for _ in range(n - 1):
            logits = self._run_step()
            if keep_logits:
                steps.append(logits.clone())
        tokens = self._tokens[:, : t + n].clone()
        if not keep_logits:
            return (tokens,)
        vocab = prefill.shape[-1]
        stacked = torch.stack(steps, 1) if steps else prefill.new_zeros(self.batch, 0, vocab)
        return tokens, prefill, stacked

    def _generate_host(
        self, ids: torch.Tensor, first: torch.Tensor, prefill: torch.Tensor, n: int, keep: bool
    ) -> tuple:
        """The decode loop on the CPU: each step's argmax is the next step's input as is,
        the tokens are kept in a list and joined once."""
        t = ids.shape[1]
        token, chosen, steps = first, [first], []
        for pos in range(t, t + n - 1):
            logits = self._host(self.net, token, self.cache, pos)
            token = logits.argmax(-1, keepdim=True)
            chosen.append(token)
            if keep:
                steps.append(logits)
        self.cache.advance(n - 1)
        tokens = torch.cat((ids, *chosen), 1)
        if not keep:
            return (tokens,)
        vocab = prefill.shape[-1]
        stacked = torch.stack(steps, 1) if steps else prefill.new_zeros(self.batch, 0, vocab)
        return tokens, prefill, stacked
