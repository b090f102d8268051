"""Speculative decoding by prompt lookup (chapter 29): drafts from the sequence itself,
verified by the model in the step's one forward.

    LLMEngine(model, speculative=SpeculativeConfig(num_tokens=4, max_batch=8))

Proposal (n-gram prompt lookup): take the sequence's last n tokens (n = 3, then 2, then
1) and find their latest earlier occurrence in the sequence's own prompt and output; the
up to k tokens that followed it are the draft. Text that repeats itself (code, quoted
input, lists, a model stuck in a loop) gets long accepted drafts; other text gets none or
short ones, and a draft costs nothing when there is no match.

Verification: the engine runs a sequence's pending token and its k drafts as one chunk of
k + 1 tokens through the paged prefill attention, so one forward gives the logits after
each of them. Greedy: the drafts are kept up to the first one that differs from the
argmax, and the argmax there is the step's extra token, so the tokens are exactly those
of plain greedy decoding, one to k + 1 per step. Sampling: with a deterministic draft
token d (probability 1 under the proposer), the rejection rule of Leviathan et al. and
Chen et al. accepts d with probability p(d), the target's probability of it, and on a
rejection draws from p with d removed and renormalised; when all k are accepted one more
token is drawn from the last row. Each emitted token then has exactly the distribution p
plain sampling draws from (`accept_sampled`; tests check it on a tiny vocabulary).

When it pays: verifying k + 1 tokens costs about the same as one while a step is bound by
reading the weights (small batches); in a large batch the step is bound by compute and k
extra tokens per sequence make it slower. The engine turns speculation off for a step
whose running batch is larger than `max_batch`, and for a sequence whose recent
acceptance (an average over its last verifications) falls below `min_acceptance` it
pauses for `backoff_steps` steps, twice as long at each pause in a row (up to 16 times),
until a verification accepts a draft again.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from opswap.errors import OpswapError
from opswap.llm.sampling import SamplingParams, apply_penalty, filter_logits

#: the running batch above which a step does not speculate. Measured (bench_engine.py
#: --part spec, the CPU, a tiny model): no crossover up to 64 on repetitive text, where
#: every step is bound by per-step overhead. On a GPU a step stays bound by reading the
#: weights while its rows (batch x (1 + 4 drafts)) are below the GEMM ridge point, a few
#: hundred rows for bf16 on an H100: 32 x 5 = 160 keeps well under it. The GPU run of the
#: same benchmark reports the measured crossover, which should replace this number.
DEFAULT_MAX_BATCH = 32


class SpeculativeError(OpswapError, ValueError):
    """A speculative-decoding setting that makes no sense."""


@dataclass
class SpeculativeConfig:
    """Prompt-lookup speculation: up to `num_tokens` drafts a sequence and step, from the
    latest earlier match of its last `max_ngram` .. `min_ngram` tokens."""

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    max_batch: int = DEFAULT_MAX_BATCH
    min_acceptance: float = 0.3
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        checks = [
            (self.num_tokens >= 1, f"num_tokens must be at least 1, got {self.num_tokens}"),
            (
                1 <= self.min_ngram <= self.max_ngram,
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}",
            ),
            (self.max_batch >= 1, f"max_batch must be at least 1, got {self.max_batch}"),
            (
                0.0 <= self.min_acceptance <= 1.0,
                f"min_acceptance must be in [0, 1], got {self.min_acceptance}",
            ),
            (self.backoff_steps >= 0, f"backoff_steps must be >= 0, got {self.backoff_steps}"),
        ]
        for ok, why in checks:
            if not ok:
                raise SpeculativeError(why + ".")


def propose(token_ids: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens (n from max_ngram down to min_ngram); [] when none occurs."""
    total = len(token_ids)
    if k < 1 or total < 2:
        return []
    # bytes.rfind runs the search in C; a hit must start on a token boundary
    words = array("q", token_ids)
    size = words.itemsize
    hay = words[: total - 1].tobytes()  # a match must leave at least one token after it
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        needle = words[total - n :].tobytes()
        end = len(hay)
        while True:
            at = hay.rfind(needle, 0, end)
            if at < 0:
                break
            if at % size == 0:
                i = at // size + n
                return list(token_ids[i : i + k])
            end = at + len(needle) - 1
    return []


class PromptLookup:
    """One sequence's proposer. It keeps the set of tokens seen before the last one, so a
    step whose last token never occurred earlier (most steps of text that does not repeat)
    skips the search: no n-gram can match without its last token matching."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.upto = 0  # token_ids[:upto] are in `seen`

    def propose(
        self, token_ids: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1
    ) -> list[int]:
        last = len(token_ids) - 1
        if self.upto < last:
            self.seen.update(token_ids[self.upto : last])
            self.upto = last
        if last < 1 or token_ids[last] not in self.seen:
            return []
        return propose(token_ids, k, max_ngram, min_ngram)


def accept_sampled(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    history: Sequence[int],
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a sampling sequence emits from rows logits [len(drafts) + 1, vocab]:
    accepted drafts, then one drawn token (the residual's on a rejection, the last row's
    when every draft is accepted)."""
    seen = list(history)
    out: list[int] = []
    for j, row in enumerate(logits):
        probs = filter_logits(apply_penalty(row, seen, params.repetition_penalty), params)
        probs = probs.softmax(-1)
        if j == len(drafts):
            out.append(int(torch.multinomial(probs, 1, generator=generator)))
            break
        d = int(drafts[j])
        u = torch.rand((), generator=generator, device=probs.device)
        if float(u) < float(probs[d]):
            out.append(d)
            seen.append(d)
            continue
        residual = probs.clone()
        residual[d] = 0.0
        # p(d) < 1 here (u < 1 always accepts p(d) = 1), so the residual has mass
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        break
    return out
