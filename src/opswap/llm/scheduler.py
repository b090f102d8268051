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
from opswap.llm.speculative import PromptLookup


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
    draft_ids: list[int] = field(default_factory=list)  # this step's speculative drafts
    spec_rate: float = 0.5  # recent share of drafts accepted (a running average)
    spec_pause: int = 0  # steps left before the sequence speculates again
    spec_pauses: int = 0  # pauses in a row (each twice as long)
    lookup: PromptLookup | None = None  # its draft proposer, made at its first decode

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class Scheduled:
    """A sequence's part of a step: `num_tokens` tokens from position `start`; `samples`:
    the chunk reaches the sequence's last token, so the step draws its next one. `drafts`:
    speculative tokens run after the chunk (positions start + num_tokens on), to verify."""

    seq: Sequence
    start: int
    num_tokens: int
    drafts: list[int] = field(default_factory=list)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class Batch:
    """One step: decodes (one token each) first, then prefill chunks and decodes carrying
    drafts (a chunk of 1 + drafts tokens), packed in order."""

    decodes: list[Scheduled]
    prefills: list[Scheduled]
    preempted: list[Sequence]

    @property
    def entries(self) -> list[Scheduled]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens + len(e.drafts) for e in self.entries)


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
            drafts = self._drafts(seq, n, budget, later=len(self.running) - i - 1)
            while not self.blocks.can_allocate(seq.request_id, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._allocate(seq, n, len(drafts))
                entry = Scheduled(seq, seq.num_computed, n, drafts)
                (decodes if n == 1 and not drafts else prefills).append(entry)
                budget -= n + len(drafts)
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

    def _drafts(self, seq: Sequence, n: int, budget: int, later: int) -> list[int]:
        """The drafts a decoding sequence runs this step: those the budget leaves room for,
        and none when their blocks would leave fewer free blocks than the `later` running
        sequences may need (drafts never cause a preemption)."""
        if not seq.draft_ids or n != 1 or seq.num_tokens - seq.num_computed != 1:
            return []
        drafts = seq.draft_ids[: budget - 1]
        rid, end = seq.request_id, seq.num_computed + 1
        extra = self.blocks.blocks_needed(rid, end + len(drafts)) - self.blocks.blocks_needed(
            rid, end
        )
        if extra and self.blocks.blocks_needed(rid, end + len(drafts)) + later > (
            self.blocks.num_free()
        ):
            return []
        return drafts

    def _allocate(self, seq: Sequence, n: int, drafts: int = 0) -> None:
        """Blocks for the sequence's next n tokens and its drafts. The blocks the n tokens
        fill are named in the prefix cache at once: the step's forward writes every
        token's keys and values at each layer before any attention of that layer reads
        them, so a prompt admitted later in the same step may already start on them.
        Drafts are named only once accepted (`accept`)."""
        end = seq.num_computed + n
        self.blocks.allocate(seq.request_id, end + drafts)
        if end // self.blocks.block_size > self.blocks.num_committed(seq.request_id):
            self.blocks.commit(seq.request_id, seq.token_ids, end)

    def finish_step(self, batch: Batch) -> None:
        """The batch ran: its tokens' keys and values are in the cache."""
        for e in batch.entries:
            e.seq.num_computed = e.start + e.num_tokens

    def accept(self, seq: Sequence, accepted: int) -> None:
        """A decode's first `accepted` drafts matched (they are in seq's tokens now): their
        keys and values count as computed; the blocks that only rejected drafts reached go
        back to the pool (their slots are written again before anything reads them)."""
        seq.num_computed += accepted
        rid = seq.request_id
        if seq.num_computed // self.blocks.block_size > self.blocks.num_committed(rid):
            self.blocks.commit(rid, seq.token_ids, seq.num_computed)
        self.blocks.truncate(rid, seq.num_computed)
