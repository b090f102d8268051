"""Choosing each sequence's next token from its logits (chapter 29).

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=1, logprobs=3)
    sampler = Sampler()
    picks = sampler(logits, [params_a, params_b], [history_a, history_b], [gen_a, gen_b])

Per row, in this order (Hugging Face's and vLLM's): the repetition penalty over every
token the sequence holds (prompt and output; a positive logit divided by the penalty, a
negative one multiplied), then greedy (temperature 0: the argmax), or the temperature,
top-k, top-p (the smallest set of most likely tokens whose probabilities sum to at least
p), min-p (tokens less likely than min_p times the most likely one dropped), and a draw
from what is left with the sequence's own `torch.Generator` when it has a seed, so that a
seeded request draws the same tokens alone or in any batch.

Log-probabilities, when asked for, are the model's: log-softmax of the raw logits before
penalty, temperature and truncation (what OpenAI's API reports, and vLLM's default), for
the chosen token and the `logprobs` most likely ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from opswap.errors import OpswapError

#: the most top_logprobs OpenAI's API returns per token
MAX_LOGPROBS = 20


class SamplingError(OpswapError, ValueError):
    """Sampling parameters that make no sense."""


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 is greedy. top_k 0 and top_p 1.0 and min_p 0.0 keep every token.
    `stop` strings end the output where they appear (the text excludes them) and need the
    engine to have a `decode` (a tokenizer). `stop_token_ids` end it after such a token.
    `logprobs`: None for none, else how many top alternatives to report with the chosen
    token's log-probability (0 to 20).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    stop: Sequence[str] = field(default_factory=tuple)
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 keeps every token), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (all(self.stop), "a stop string must not be empty"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be None or 0 to {MAX_LOGPROBS}, got {self.logprobs}",
            ),
        ]
        for ok, why in checks:
            if not ok:
                raise SamplingError(why + ".")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the `logprobs` most likely tokens'."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Pick:
    token: int
    logprob: TokenLogprob | None


def apply_penalty(logits: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """A row's logits [vocab] with the repetition penalty on the tokens seen."""
    if penalty == 1.0 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), device=logits.device, dtype=torch.long)
    picked = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """A row's logits [vocab] after temperature, top-k, top-p and min-p (dropped: -inf)."""
    x = logits.float() / p.temperature
    vocab = x.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        probs, order = x.softmax(-1).sort(descending=True)
        before = probs.cumsum(-1) - probs  # mass of the tokens more likely than each
        drop = torch.zeros_like(x, dtype=torch.bool)
        drop[order] = before >= p.top_p
        x = x.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


def sampling_probs(logits: torch.Tensor, p: SamplingParams, seen: Sequence[int]) -> torch.Tensor:
    """The distribution [vocab] a row draws from (for tests and inspection); greedy rows
    put all of it on the argmax."""
    if p.greedy:
        row = apply_penalty(logits, seen, p.repetition_penalty)
        return torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).float()
    return filter_logits(apply_penalty(logits, seen, p.repetition_penalty), p).softmax(-1)


class Sampler:
    """Picks one token per row of a batch of logits, each row with its own params."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seen: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
    ) -> list[Pick]:
        """logits [B, vocab]; seen[b]: the tokens row b holds (for the penalty)."""
        want = [p.logprobs is not None for p in params]
        logp = torch.log_softmax(logits.float(), -1) if any(want) else None
        picks = []
        for b, p in enumerate(params):
            row = apply_penalty(logits[b], seen[b], p.repetition_penalty)
            if p.greedy:
                token = int(torch.argmax(row))
            else:
                probs = filter_logits(row, p).softmax(-1)
                token = int(torch.multinomial(probs, 1, generator=generators[b]))
            lp = None
            if logp is not None and p.logprobs is not None:
                lp = _logprob(logp[b], token, p.logprobs)
            picks.append(Pick(token, lp))
        return picks


def _logprob(logp: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(logp, min(k, logp.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), top)


def make_generator(p: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own generator when it has a seed (None: torch's global one)."""
    if p.seed is None or p.greedy:
        return None
    return torch.Generator(device=device).manual_seed(p.seed)


Decode = Callable[[Sequence[int]], str]
