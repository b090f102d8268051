"""The serving engine (chapter 29): requests come and go between steps; each step runs one
forward over the packed tokens of every scheduled sequence, against a paged KV cache.

    engine = LLMEngine(model, block_size=16, num_blocks=512, max_model_len=2048)
    rid = engine.add_request([1, 15, 20], SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():          # token deltas, per request
            print(out.request_id, out.new_token_ids, out.finish_reason)
    engine.abort(rid)                      # at any time between steps

The model's math comes from a `ModelRunner` (llm/runner.py), picked by the model's class:
Llama, Mistral and Qwen2 (`HFDecoder`'s weights and layer functions) and GPT-2. A step
packs the batch's tokens into one [T, hidden] stream (decodes first, then prefill chunks):
every layer runs its norms, projections and MLP once over all T tokens; the engine's
`attend` writes each token's keys and values to its slot of the paged cache (the slot
mapping) and attends with `paged_decode_attention` (one query per decoding sequence) and
`paged_prefill_attention` (each chunk against its sequence's cache). The LM head runs
only on the rows whose sequence draws a token this step: the last token of a sequence's
pending tokens. On the CPU the attention is the PyTorch reference; on a GPU the same
calls pick kernels.

Options: `speculative=SpeculativeConfig(...)` (or True) verifies prompt-lookup drafts in
the same forward (llm/speculative.py); `cuda_graphs` (default on CUDA) replays a captured
decode-only step at bucketed batch sizes (1, 2, 4, 8, 16, 32, 64, ...); `weights`
("int8", "int4", "fp8") stores the projections low-bit (llm/quant.py);
`tensor_parallel=N` splits the heads and MLP columns over N ranks (llm/tensor_parallel.py:
this process is rank 0 and drives the others; `close()` stops them).

Nothing blocks between steps, so a server can call `add_request`, `abort` and `step` from
one event loop; each `RequestOutput` carries what is new since the last one (tokens, text,
log-probabilities) and, at the end, the finish reason: "stop" (a stop token or string),
"length" (max_tokens, or max_model_len reached) or "abort".
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from opswap.errors import OpswapError
from opswap.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from opswap.llm import tensor_parallel as tpm
from opswap.llm.blocks import BlockManager, BlockStats
from opswap.llm.quant import WeightQuant, WeightStats, quantize_runner
from opswap.llm.runner import ModelRunner, make_runner, run_model
from opswap.llm.sampling import (
    Pick,
    Sampler,
    SamplingParams,
    TokenLogprob,
    _logprob,
    make_generator,
)
from opswap.llm.scheduler import Batch, Scheduled, Scheduler
from opswap.llm.scheduler import Sequence as Seq
from opswap.llm.speculative import PromptLookup, SpeculativeConfig, accept_sampled
from opswap.llm.tensor_parallel import TPError, TPGroup

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
    draft_tokens: int = 0  # speculative drafts verified
    accepted_tokens: int = 0  # of them, accepted
    graph_steps: int = 0  # steps replayed from a CUDA graph
    weight_bytes: int = 0  # Linear weights a decode step reads, as stored (llm.quant)
    float_weight_bytes: int = 0  # the same in the run's dtype

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class LLMEngine:
    """Continuous batching of generation requests over a paged KV cache.

    KV memory: `num_blocks` blocks of `block_size` tokens, or as many as `kv_memory` bytes
    hold, or by default room for max_num_seqs sequences of max_model_len tokens.
    `decode(ids) -> str` (a tokenizer's) gives outputs their text and enables stop strings.
    `speculative` (a SpeculativeConfig, or True for the defaults) verifies prompt-lookup
    drafts in each step's forward; greedy tokens are unchanged. `cuda_graphs` (default:
    on for a CUDA device) replays decode-only steps of up to `graph_max_batch` sequences
    from CUDA graphs captured at bucketed batch sizes. `weights` ("int8", "int4", "fp8"
    or a WeightQuant) stores every projection low-bit (llm/quant.py; the LM head stays in
    `dtype` unless WeightQuant(lm_head=True)); `weight_stats` gives the bytes saved.
    `tensor_parallel` N > 1 spawns ranks 1..N-1 (cuda:r on CUDA, gloo processes on the
    CPU), each holding 1/N of every layer's heads and MLP, and broadcasts each step to
    them; `tp_timeout_s` bounds a step's collectives (a rank that hangs or fails is one
    TPError sentence here). `kv_memory` is then per rank. Call `close()` when done.
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
        speculative: SpeculativeConfig | bool | None = None,
        cuda_graphs: bool | None = None,
        graph_max_batch: int = 64,
        weights: str | WeightQuant | None = None,
        tensor_parallel: int = 1,
        tp_timeout_s: float = 60.0,
        _tp_rank: int = 0,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("graph_max_batch", graph_max_batch),
            ("tensor_parallel", tensor_parallel),
        ):
            if value < 1:
                raise EngineError(f"{name} must be at least 1, got {value}.")
        config = getattr(model, "config", None)
        if max_model_len is None:
            max_model_len = int(getattr(config, "max_position_embeddings", 2048))
        if max_model_len < 1:
            raise EngineError(f"max_model_len must be at least 1, got {max_model_len}.")
        self.tp: TPGroup | None = None
        self.tp_rank, self.tensor_parallel = _tp_rank, tensor_parallel
        if tensor_parallel == 1:
            self.runner: ModelRunner = make_runner(model, max_model_len, device, dtype)
        else:
            if cuda_graphs is None:
                cuda_graphs = torch.device(device).type == "cuda"
            rank_dev = tpm.rank_device(device, _tp_rank, tensor_parallel)
            # the whole runner on the CPU (the model's own tensors where the dtype matches),
            # refused before any process starts when it cannot be split; then rank's shard
            full = make_runner(model, max_model_len, "cpu", dtype)
            tpm.split_for(full, tensor_parallel)
            worker_kwargs: dict[str, Any] = {}
            if _tp_rank == 0:
                worker_kwargs = dict(
                    block_size=block_size, num_blocks=num_blocks, kv_memory=kv_memory,
                    max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, device=device,
                    dtype=dtype, prefix_caching=prefix_caching, cuda_graphs=cuda_graphs,
                    graph_max_batch=graph_max_batch, weights=weights, tp_timeout_s=tp_timeout_s,
                )  # fmt: skip
            self.runner = tpm.shard_runner(full, _tp_rank, tensor_parallel, rank_dev)
            del full
        self.weight_stats: WeightStats = quantize_runner(self.runner, weights)
        net = self.runner
        self.device, self.dtype = net.device, dtype
        layers = net.num_layers
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
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and not (self.device.type == "cuda" and torch.cuda.is_available()):
            raise EngineError("cuda_graphs=True needs a CUDA device; pass device='cuda'.")
        if speculative is True:
            speculative = SpeculativeConfig()
        self.spec: SpeculativeConfig | None = speculative or None
        # one block more than the pool, never handed out: a graph bucket's padded rows
        # write their keys and values there
        shape = (layers, self.num_blocks + 1, block_size, net.kv_heads, net.head_dim)
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
        self._drafted = self._accepted = self._graph_steps = 0
        graph_batch = min(graph_max_batch, max_num_seqs)
        self.graphs = _DecodeGraphs(self, graph_batch) if cuda_graphs else None
        if tensor_parallel > 1 and _tp_rank == 0:
            # the other ranks start last, once everything here that can refuse has passed
            self.tp = tpm.launch(
                type(self), model, worker_kwargs, tensor_parallel, self.device, tp_timeout_s
            )
            self._finalizer = weakref.finalize(self, self.tp.close)
            tpm.wait_ready(self.tp)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one process); the engine
        takes no step after."""
        if self.tp is not None:
            self.tp.close()

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
        bad = [t for t in prompt if not 0 <= t < self.runner.vocab]
        if bad:
            raise EngineError(
                f"the prompt of request {request_id!r} holds token {bad[0]}, outside the "
                f"model's vocabulary of {self.runner.vocab}."
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
            draft_tokens=self._drafted,
            accepted_tokens=self._accepted,
            graph_steps=self._graph_steps,
            weight_bytes=self.weight_stats.stored_bytes,
            float_weight_bytes=self.weight_stats.float_bytes,
        )

    # -- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, draw tokens; the outputs of requests that moved."""
        if self.tp is None:
            return self._step()
        try:
            return self._step()
        except TPError:
            raise
        except RuntimeError as e:  # a collective that failed or timed out
            raise self.tp.explain(e) from e

    def _step(self) -> list[RequestOutput]:
        self._propose()
        batch = self.scheduler.schedule()
        for seq in (*self.scheduler.running, *batch.preempted):
            seq.draft_ids = []  # drafts are for this step only
        if not batch.entries:
            if self.has_unfinished():
                raise EngineError("the scheduler found nothing to run; this is a bug in opswap.")
            return []
        sampling = [e for e in batch.entries if e.samples]
        if self.graphs is not None and self.graphs.takes(batch):
            logits = self.graphs.run(batch.decodes)
            self._graph_steps += 1
        else:
            logits = self._forward(batch, sampling)
        self.scheduler.finish_step(batch)
        self._steps += 1
        self._tokens_computed += batch.num_tokens
        # rows of `logits`: one per sampling entry, 1 + drafts for an entry with drafts
        rows: list[int] = []
        at = 0
        for e in sampling:
            rows.append(at)
            at += 1 + len(e.drafts)
        plain = [i for i, e in enumerate(sampling) if not e.drafts]
        seqs = [sampling[i].seq for i in plain]
        plain_picks = self.sampler(
            logits[[rows[i] for i in plain]],
            [s.params for s in seqs],
            [s.token_ids for s in seqs],
            [s.generator for s in seqs],
        )
        picks: dict[int, list[Pick]] = {i: [p] for i, p in zip(plain, plain_picks, strict=True)}
        for i, e in enumerate(sampling):
            if e.drafts:
                picks[i] = self._verify(e, logits[rows[i] : rows[i] + 1 + len(e.drafts)])
        outputs = []
        for i, e in enumerate(sampling):
            seq = e.seq
            for pick in picks[i]:
                seq.output_ids.append(pick.token)
                if pick.logprob is not None:
                    seq.logprobs.append(pick.logprob)
                self._check_finish(seq)
                if seq.finish_reason is not None:
                    break
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)
                del self._requests[seq.request_id]
            elif e.drafts:
                self.scheduler.accept(seq, len(picks[i]) - 1)
            outputs.append(self._output(seq))
        return outputs

    # -- speculation ---------------------------------------------------------------------

    def _propose(self) -> None:
        """Drafts for the running decodes, unless the batch is too large to gain."""
        cfg = self.spec
        running = self.scheduler.running
        if cfg is None or len(running) > cfg.max_batch:
            return
        for seq in running:
            if seq.num_tokens - seq.num_computed != 1:
                continue  # still prefilling
            if seq.spec_pause > 0:
                seq.spec_pause -= 1
                continue
            # room: the model's length, and drafts past max_tokens would be thrown away
            room = min(
                cfg.num_tokens,
                self.max_model_len - seq.num_tokens,
                seq.params.max_tokens - len(seq.output_ids) - 1,
            )
            if room > 0:
                if seq.lookup is None:
                    seq.lookup = PromptLookup()
                ids = seq.token_ids
                seq.draft_ids = seq.lookup.propose(ids, room, cfg.max_ngram, cfg.min_ngram)

    def _verify(self, e: Scheduled, logits: torch.Tensor) -> list[Pick]:
        """The tokens a decode with drafts emits from its rows [1 + drafts, vocab]: the
        accepted drafts and one more (the model's own token after the last accepted)."""
        seq, p, drafts = e.seq, e.seq.params, e.drafts
        history = seq.token_ids
        tokens: list[int]
        if p.greedy and p.repetition_penalty == 1.0:  # the argmax of every row at once
            tokens = []
            for j, t in enumerate(logits.argmax(-1).tolist()):
                tokens.append(int(t))
                if j == len(drafts) or t != drafts[j]:
                    break
        elif p.greedy:  # the penalty sees the drafts accepted before each row
            tokens = []
            for j in range(len(drafts) + 1):
                pick = self.sampler(logits[j : j + 1], [p], [history + tokens], [None])[0]
                tokens.append(pick.token)
                if j == len(drafts) or pick.token != drafts[j]:
                    break
        else:
            tokens = accept_sampled(logits, drafts, p, history, seq.generator)
        accepted = len(tokens) - 1
        self._drafted += len(drafts)
        self._accepted += accepted
        cfg = self.spec
        assert cfg is not None
        seq.spec_rate = 0.5 * seq.spec_rate + 0.5 * accepted / len(drafts)
        if seq.spec_rate < cfg.min_acceptance:
            # each pause in a row twice as long as the last (up to 16 times backoff_steps):
            # text that does not repeat itself soon costs almost nothing
            seq.spec_pause = cfg.backoff_steps << min(seq.spec_pauses, 4)
            seq.spec_pauses += 1
            seq.spec_rate = 0.5
        elif accepted:
            seq.spec_pauses = 0
        logp = torch.log_softmax(logits.float(), -1) if p.logprobs is not None else None
        return [
            Pick(
                t, None if logp is None or p.logprobs is None else _logprob(logp[j], t, p.logprobs)
            )
            for j, t in enumerate(tokens)
        ]

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
        """Logits of the sampling entries' rows (the last token's; every row of an entry
        with drafts), after writing the batch's keys and values."""
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: dict[int, int] = {}  # id(seq) -> row of its last token in the packed stream
        for e in batch.entries:
            table, lo, hi = self.blocks.table(e.seq.request_id), e.start, e.start + e.num_tokens
            ids += e.seq.token_ids[lo:hi] + e.drafts
            hi += len(e.drafts)
            positions += range(lo, hi)
            slots += [table[p // bs] * bs + p % bs for p in range(lo, hi)]
            last[id(e.seq)] = len(ids) - 1
        dec_lens = [e.start + 1 for e in batch.decodes]
        pre_lens = [e.start + e.num_tokens + len(e.drafts) for e in batch.prefills]
        cu = [0]
        for e in batch.prefills:
            cu.append(cu[-1] + e.num_tokens + len(e.drafts))
        rows: list[int] = []
        for e in sampling:
            end = last[id(e.seq)]
            rows += range(end - len(e.drafts), end + 1)

        def ints(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        i32 = torch.int32
        args = (
            ints(ids), ints(positions), ints(slots),
            self._tables(batch.decodes), ints(dec_lens, i32),
            self._tables(batch.prefills), ints(cu, i32), ints(pre_lens, i32),
        )  # fmt: skip
        if self.tp is not None:
            self.tp.send("run", args)
        return self._run(*args, ints(rows))

    def run_remote(self, op: str, ints: list[int], tensors: list[torch.Tensor | None]) -> None:
        """A worker rank's part of a step rank 0 sent (llm/tensor_parallel.py): the same
        forward on this rank's shard, its logits dropped."""
        if op == "run":
            a = tensors
            self._run(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], None)  # type: ignore[arg-type]
        elif op == "graph" and self.graphs is not None:
            names = _DecodeGraphs.NAMES
            self.graphs.replay(dict(zip(names, tensors, strict=True)), ints[0])  # type: ignore[arg-type]
        else:
            raise EngineError(f"a tensor-parallel worker got an unknown step {op!r}.")

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        dec_tables: torch.Tensor,
        dec_lens: torch.Tensor,
        pre_tables: torch.Tensor | None,
        cu_q: torch.Tensor | None,
        pre_lens: torch.Tensor | None,
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """One forward over packed tokens: the first len(dec_lens) are decodes, the rest
        prefill chunks (cu_q); logits of `rows` (all when None). Python values only from
        shapes, so a decode-only call (pre_* None) can be captured as a CUDA graph."""
        net = self.runner
        nd = dec_lens.shape[0]
        kv, d = net.kv_heads, net.head_dim

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.view(-1, kv, d).index_copy_(0, slots, k)
            vc.view(-1, kv, d).index_copy_(0, slots, v)
            parts = []
            if nd:
                parts.append(
                    paged_decode_attention(q[:nd], kc, vc, dec_tables, dec_lens, net.scale)
                )
            if nd < q.shape[0]:
                assert pre_tables is not None and cu_q is not None and pre_lens is not None
                parts.append(
                    paged_prefill_attention(q[nd:], kc, vc, pre_tables, cu_q, pre_lens, net.scale)
                )
            return torch.cat(parts) if len(parts) > 1 else parts[0]  # [T, H, D]

        return run_model(net, ids, positions, attend, rows)


def _buckets(largest: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= largest."""
    out = [1]
    while out[-1] < largest:
        out.append(out[-1] * 2)
    return out


class _DecodeGraphs:
    """CUDA graphs of the decode-only step, one per bucketed batch size, captured at first
    use. Inputs live in static buffers: token ids, positions, slots, block tables padded
    to max_model_len's width, context lengths. A batch of n decodes runs the graph of the
    smallest bucket >= n; the padded rows read and write only the spare block past the
    pool (their logits are dropped)."""

    def __init__(self, engine: LLMEngine, max_batch: int, capture: bool = True) -> None:
        self.engine, self.capture = engine, capture  # capture False: run the buckets eagerly
        self.buckets = _buckets(max(1, max_batch))
        b, dev = self.buckets[-1], engine.device
        self.width = _blocks_for(engine.max_model_len, engine.block_size)
        self.pad_block = engine.num_blocks  # the spare block, never handed out
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.zeros(b, dtype=torch.long, device=dev)
        self.tables = torch.zeros(b, self.width, dtype=torch.int32, device=dev)
        self.lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None

    def takes(self, batch: Batch) -> bool:
        return not batch.prefills and 0 < len(batch.decodes) <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def inputs(self, entries: list[Scheduled], b: int) -> dict[str, torch.Tensor]:
        """The bucket's host-side inputs: the entries' rows, then padding rows."""
        eng, bs, pad = self.engine, self.engine.block_size, self.pad_block
        tables = torch.full((b, self.width), pad, dtype=torch.int32)
        ids, pos, slots = [0] * b, [0] * b, [pad * bs] * b
        lens = [1] * b
        for r, e in enumerate(entries):
            table, p = eng.blocks.table(e.seq.request_id), e.start
            tables[r, : len(table)] = torch.tensor(table, dtype=torch.int32)
            ids[r], pos[r], lens[r] = e.seq.token_ids[p], p, p + 1
            slots[r] = table[p // bs] * bs + p % bs
        return {
            "ids": torch.tensor(ids),
            "positions": torch.tensor(pos),
            "slots": torch.tensor(slots),
            "tables": tables,
            "lens": torch.tensor(lens, dtype=torch.int32),
        }

    def _step(self, b: int) -> torch.Tensor:
        return self.engine._run(
            self.ids[:b], self.positions[:b], self.slots[:b], self.tables[:b], self.lens[:b],
            None, None, None, None,
        )  # fmt: skip

    NAMES = ("ids", "positions", "slots", "tables", "lens")

    def run(self, entries: list[Scheduled]) -> torch.Tensor:
        """Logits [len(entries), vocab] of a decode-only batch, by replaying its bucket."""
        n = len(entries)
        b = self.bucket(n)
        host = self.inputs(entries, b)
        if self.engine.tp is not None:  # every rank replays its graph of this bucket
            self.engine.tp.send("graph", [host[k] for k in self.NAMES], [b])
        return self.replay(host, b)[:n]

    def replay(self, host: dict[str, torch.Tensor], b: int) -> torch.Tensor:
        """The bucket b's logits [b, vocab] of these inputs (padded to b rows)."""
        for name, value in host.items():
            getattr(self, name)[:b].copy_(value, non_blocking=True)
        if not self.capture:
            return self._step(b)
        if b not in self.graphs:
            self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out

    def _capture(self, b: int) -> None:
        # warm-up on a side stream (autotuning, lazy init), as torch.cuda.graphs asks;
        # it writes the same keys and values to the same slots as the replay will
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(b)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[b] = (graph, out)
