"""The serving engine (chapter 29): requests come and go between steps; each step runs one
forward over the packed tokens of every scheduled sequence, against a paged KV cache.

    engine = LLMEngine(model, block_size=16, num_blocks=512, max_model_len=2048)
    rid = engine.add_request([1, 15, 20], SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():          # token deltas, per request
            print(out.request_id, out.new_token_ids, out.finish_reason)
    engine.abort(rid)                      # at any time between steps

The model is a Hugging Face Llama-style causal LM; its weights and layer math are
`HFDecoder`'s. A step packs the batch's tokens into one [T, hidden] stream (decodes first,
then prefill chunks): every layer runs its norms, projections and MLP once over all T
tokens, rotates q and k at each token's own position, writes each token's keys and values
to its slot of the paged cache (the slot mapping), and attends with
`paged_decode_attention` (one query per decoding sequence) and `paged_prefill_attention`
(each prefill chunk against its sequence's cache). The LM head runs only on the rows
whose sequence draws a token this step: the last token of a sequence's pending tokens.
On the CPU the attention is the PyTorch reference; on a GPU the same calls pick kernels.

Nothing blocks between steps, so a server can call `add_request`, `abort` and `step` from
one event loop; each `RequestOutput` carries what is new since the last one (tokens, text,
log-probabilities) and, at the end, the finish reason: "stop" (a stop token or string),
"length" (max_tokens, or max_model_len reached) or "abort".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from opswap.errors import OpswapError
from opswap.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from opswap.llm.blocks import BlockManager, BlockStats
from opswap.llm.hf_decoder import SUPPORTED, HFDecoder, _linear
from opswap.llm.sampling import Sampler, SamplingParams, TokenLogprob, make_generator
from opswap.llm.scheduler import Batch, Scheduled, Scheduler
from opswap.llm.scheduler import Sequence as Seq

FINISH_REASONS = ("stop", "length", "abort")


class EngineError(OpswapError, ValueError):
    """An engine setting or a request that the engine cannot take."""


@dataclass
class RequestOutput:
    """What one step produced for one request: the new part and the totals so far."""

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    new_text: str
    text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class EngineStats:
    blocks: BlockStats
    running: int
    waiting: int
    preemptions: int
    steps: int
    tokens_computed: int


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class LLMEngine:
    """Continuous batching of generation requests over a paged KV cache.

    KV memory: `num_blocks` blocks of `block_size` tokens, or as many as `kv_memory` bytes
    hold, or by default room for max_num_seqs sequences of max_model_len tokens.
    `decode(ids) -> str` (a tokenizer's) gives outputs their text and enables stop strings.
    """

    def __init__(
        self,
        model: Any,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 512,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        prefix_caching: bool = True,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if value < 1:
                raise EngineError(f"{name} must be at least 1, got {value}.")
        config = getattr(model, "config", None)
        if max_model_len is None:
            max_model_len = int(getattr(config, "max_position_embeddings", 2048))
        if max_model_len < 1:
            raise EngineError(f"max_model_len must be at least 1, got {max_model_len}.")
        name = type(model).__name__
        if name not in SUPPORTED:
            raise EngineError(
                f"LLMEngine runs {', '.join(SUPPORTED)}; {name} has another layout, which the "
                "engine does not run yet."
            )
        self.net = HFDecoder(model, max_len=max_model_len, device=device, dtype=dtype)
        net = self.net
        self.device, self.dtype = net.device, dtype
        layers = len(net.layers)
        block_bytes = 2 * layers * block_size * net.kv_heads * net.head_dim * dtype.itemsize
        if num_blocks is not None and kv_memory is not None:
            raise EngineError("give num_blocks or kv_memory, not both.")
        if kv_memory is not None:
            num_blocks = kv_memory // block_bytes
            if num_blocks < 1:
                raise EngineError(
                    f"kv_memory of {kv_memory} bytes holds no KV block ({block_bytes} bytes "
                    f"each at block_size {block_size}); give at least {block_bytes} bytes."
                )
        elif num_blocks is None:
            num_blocks = max_num_seqs * _blocks_for(max_model_len, block_size)
        if num_blocks * block_size < max_model_len:
            raise EngineError(
                f"the KV cache of {num_blocks} blocks of {block_size} tokens cannot hold one "
                f"sequence of max_model_len {max_model_len}; use max_model_len <= "
                f"{num_blocks * block_size} or more KV memory ({block_bytes} bytes a block)."
            )
        self.block_size, self.num_blocks = block_size, int(num_blocks)
        self.max_model_len = max_model_len
        shape = (layers, self.num_blocks, block_size, net.kv_heads, net.head_dim)
        # k_cache[i]: layer i's [num_blocks, block_size, kv_heads, head_dim]
        self.k_cache = torch.zeros(shape, device=self.device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=dtype)
        self.blocks = BlockManager(self.num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler()
        self.decode = decode
        self._requests: dict[str, Seq] = {}
        self._ids = itertools.count()
        self._steps = 0
        self._tokens_computed = 0

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. It joins the running batch at a later step."""
        params = params if params is not None else SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise EngineError(f"request id {request_id!r} is already in use.")
        if not prompt:
            raise EngineError(
                f"request {request_id!r} has an empty prompt; give at least one token."
            )
        if len(prompt) > self.max_model_len:
            raise EngineError(
                f"the prompt of request {request_id!r} has {len(prompt)} tokens, more than "
                f"max_model_len {self.max_model_len}."
            )
        bad = [t for t in prompt if not 0 <= t < self.net.vocab]
        if bad:
            raise EngineError(
                f"the prompt of request {request_id!r} holds token {bad[0]}, outside the "
                f"model's vocabulary of {self.net.vocab}."
            )
        if params.stop and self.decode is None:
            raise EngineError(
                "stop strings need text: give the engine a tokenizer's decode (decode=...)."
            )
        seq = Seq(request_id, prompt, params, make_generator(params, self.device))
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None when it is unknown or finished."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            blocks=self.blocks.stats(),
            running=len(s.running),
            waiting=len(s.waiting),
            preemptions=s.num_preemptions,
            steps=self._steps,
            tokens_computed=self._tokens_computed,
        )

    # -- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, draw tokens; the outputs of requests that moved."""
        batch = self.scheduler.schedule()
        if not batch.entries:
            if self.has_unfinished():
                raise EngineError("the scheduler found nothing to run; this is a bug in opswap.")
            return []
        sampling = [e for e in batch.entries if e.samples]
        logits = self._forward(batch, sampling)
        self.scheduler.finish_step(batch)
        self._steps += 1
        self._tokens_computed += batch.num_tokens
        seqs = [e.seq for e in sampling]
        picks = self.sampler(
            logits,
            [s.params for s in seqs],
            [s.token_ids for s in seqs],
            [s.generator for s in seqs],
        )
        outputs = []
        for seq, pick in zip(seqs, picks, strict=True):
            seq.output_ids.append(pick.token)
            if pick.logprob is not None:
                seq.logprobs.append(pick.logprob)
            self._check_finish(seq)
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)
                del self._requests[seq.request_id]
            outputs.append(self._output(seq))
        return outputs

    def _check_finish(self, seq: Seq) -> None:
        p, token = seq.params, seq.output_ids[-1]
        stopped = token in p.stop_token_ids
        if self.decode is not None:
            ids = seq.output_ids[:-1] if stopped else seq.output_ids
            text = self.decode(ids)
            for s in p.stop:
                at = text.find(s, max(0, len(seq.text) - len(s) + 1))
                if at >= 0:
                    text, stopped = text[:at], True
            seq.text = text
        if stopped:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _output(self, seq: Seq) -> RequestOutput:
        done = seq.finish_reason is not None
        text_end = len(seq.text)
        if not done:
            if seq.params.stop:  # hold back what may be the start of a stop string
                text_end -= max(len(s) for s in seq.params.stop) - 1
            # and a character still waiting for the rest of its UTF-8 bytes
            while text_end > seq.sent_text and seq.text[text_end - 1] == "\ufffd":
                text_end -= 1
            text_end = max(seq.sent_text, text_end)
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.output_ids[seq.sent_tokens :],
            token_ids=list(seq.output_ids),
            new_text=seq.text[seq.sent_text : text_end],
            text=seq.text[:text_end],
            new_logprobs=seq.logprobs[seq.sent_tokens :],
            finished=done,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached,
        )
        seq.sent_tokens, seq.sent_text = len(seq.output_ids), text_end
        return out

    # -- the model runner ----------------------------------------------------------------

    def _tables(self, entries: list[Scheduled]) -> torch.Tensor:
        """int32 [S, max blocks] block tables of the entries' sequences (0-padded)."""
        tables = [self.blocks.table(e.seq.request_id) for e in entries]
        width = max((len(t) for t in tables), default=1)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32, device=self.device)

    def _forward(self, batch: Batch, sampling: list[Scheduled]) -> torch.Tensor:
        """Logits [len(sampling), vocab] after writing the batch's keys and values."""
        net, bs, dev = self.net, self.block_size, self.device
        entries = batch.entries
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: dict[int, int] = {}  # id(seq) -> row of its last token in the packed stream
        for e in entries:
            table, lo, hi = self.blocks.table(e.seq.request_id), e.start, e.start + e.num_tokens
            ids += e.seq.token_ids[lo:hi]
            positions += range(lo, hi)
            slots += [table[p // bs] * bs + p % bs for p in range(lo, hi)]
            last[id(e.seq)] = len(ids) - 1
        t = len(ids)
        nd = len(batch.decodes)
        pos = torch.tensor(positions, device=dev)[None]  # [1, T]
        slot = torch.tensor(slots, device=dev)
        dec_tables = self._tables(batch.decodes)
        dec_lens = torch.tensor([e.start + 1 for e in batch.decodes], dtype=torch.int32, device=dev)
        pre_tables = self._tables(batch.prefills)
        pre_lens = torch.tensor(
            [e.start + e.num_tokens for e in batch.prefills], dtype=torch.int32, device=dev
        )
        cu = [0]
        for e in batch.prefills:
            cu.append(cu[-1] + e.num_tokens)
        cu_q = torch.tensor(cu, dtype=torch.int32, device=dev)

        layers = net.layers
        x = net.embed[torch.tensor(ids, device=dev)][None]  # [1, T, hidden]
        h = net._norm(x, layers[0].ln1, layers[0].eps1)
        for i, layer in enumerate(layers):
            q, k, v = net._qkv(h, layer, pos)  # q [1, H, T, D], k, v [1, H_kv, T, D]
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.view(-1, net.kv_heads, net.head_dim).index_copy_(0, slot, k[0].transpose(0, 1))
            vc.view(-1, net.kv_heads, net.head_dim).index_copy_(0, slot, v[0].transpose(0, 1))
            q = q[0].transpose(0, 1)  # [T, H, D]
            parts = []
            if nd:
                parts.append(
                    paged_decode_attention(q[:nd], kc, vc, dec_tables, dec_lens, net.scale)
                )
            if nd < t:
                parts.append(
                    paged_prefill_attention(q[nd:], kc, vc, pre_tables, cu_q, pre_lens, net.scale)
                )
            o = torch.cat(parts) if len(parts) > 1 else parts[0]  # [T, H, D]
            a = _linear(o.reshape(1, t, -1), layer.wo, layer.bo)
            h, x = net._add_norm(a, x, layer.ln2, layer.eps2)
            m = net._mlp(h, layer)
            w, eps = (
                (layers[i + 1].ln1, layers[i + 1].eps1)
                if i + 1 < len(layers)
                else (net.norm, net.norm_eps)
            )
            h, x = net._add_norm(m, x, w, eps)
        rows = torch.tensor([last[id(e.seq)] for e in sampling], dtype=torch.long, device=dev)
        return _linear(h[0, rows], net.lm_head, net.lm_bias)
