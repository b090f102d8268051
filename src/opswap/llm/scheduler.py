"""Continuous (iteration-level) batching over the paged KV cache (chapter 29).

Each `schedule()` builds one step's batch under a token budget (`max_num_batched_tokens`)
and a cap on sequences (`max_num_seqs`). Sequences already running go first, in the order
they were admitted: a decoding one brings one token, one still prefilling brings the next
chunk of its prompt (a long prompt is split across steps, so it never stalls the decodes
of the others). Then waiting requests are admitted, oldest first, each with as much of
its prompt as the budget leaves, starting after the longest prefix the prefix cache holds.

When the pool cannot hold a running sequence's next tokens, the most recently admitted
running sequence is preempted by recomputation: its blocks are freed and it goes back to
the front of the queue, to prefill its prompt and the tokens it has generated so far
again (through the prefix cache, when its blocks have not been evicted meanwhile).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from opswap.llm.blocks import BlockManager
from opswap.llm.sampling import SamplingParams, TokenLogprob


@dataclass(eq=False)  # compared by identity: two requests are never the same one
class Sequence:
    """One request's state: its tokens, how many have KV in the cache, its output."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    num_cached: int = 0  # of the prompt, found in the prefix cache at the last admission
    preemptions: int = 0
    finish_reason: str | None = None
    text: str = ""  # decoded output (with stop strings cut), when the engine decodes
    sent_tokens: int = 0  # output tokens already streamed
    sent_text: int = 0  # characters already streamed

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class Scheduled:
    """A sequence's part of a step: `num_tokens` tokens from position `start`; `samples`:
    the chunk reaches the sequence's last token, so the step draws its next one."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class Batch:
    """One step: decodes (one token each) first, then prefill chunks, packed in order."""

    decodes: list[Scheduled]
    prefills: list[Scheduled]
    preempted: list[Sequence]

    @property
    def entries(self) -> list[Scheduled]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


class Scheduler:
    """Waiting and running sequences over one BlockManager."""

    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        decodes: list[Scheduled] = []
        prefills: list[Scheduled] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.can_allocate(seq.request_id, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._allocate(seq, n)
                entry = Scheduled(seq, seq.num_computed, n)
                (decodes if n == 1 else prefills).append(entry)
                budget -= n
                i += 1
                continue
            break  # the sequence preempted itself: nothing after it is left to run
        # no admissions in a step that had to preempt: the pool is short already
        while self.waiting and not preempted and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            ids = seq.token_ids
            prefix = self.blocks.cached_prefix(ids)
            n = min(len(ids) - len(prefix) * self.blocks.block_size, budget)
            if not self.blocks.fits_new(prefix, n):
                break
            self.waiting.popleft()
            seq.num_computed = seq.num_cached = self.blocks.admit(seq.request_id, ids, prefix)
            self._allocate(seq, n)
            self.running.append(seq)
            prefills.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
        return Batch(decodes, prefills, preempted)

    def _allocate(self, seq: Sequence, n: int) -> None:
        """Blocks for the sequence's next n tokens. The blocks they fill are named in the
        prefix cache at once: the step's forward writes every token's keys and values at
        each layer before any attention of that layer reads them, so a prompt admitted
        later in the same step may already start on them."""
        end = seq.num_computed + n
        self.blocks.allocate(seq.request_id, end)
        if end // self.blocks.block_size > self.blocks.num_committed(seq.request_id):
            self.blocks.commit(seq.request_id, seq.token_ids, end)

    def finish_step(self, batch: Batch) -> None:
        """The batch ran: its tokens' keys and values are in the cache."""
        for e in batch.entries:
            e.seq.num_computed = e.start + e.num_tokens
