"""Offline generation for a batch of prompts through the serving engine (chapter 29).

    from opswap.llm import SamplingParams, generate
    results = generate(model, ["Hello", "The sky is"], SamplingParams(max_tokens=20),
                       tokenizer=tok, block_size=16)
    results[0].text, results[0].token_ids, results[0].finish_reason

Every prompt is queued at once and the engine's continuous batching runs them to the
end; results come back in the prompts' order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opswap.llm.engine import EngineError, LLMEngine
from opswap.llm.sampling import SamplingParams, TokenLogprob


@dataclass
class GenerateResult:
    """One prompt's generation: its output tokens, their text (with a tokenizer), why it
    ended and, when asked for, the log-probabilities of each output token."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    num_cached_tokens: int


def generate(
    model: Any,
    prompts: Sequence[Sequence[int] | str],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    tokenizer: Any = None,
    **engine_options: Any,
) -> list[GenerateResult]:
    """Generate for every prompt (token id lists, or strings with a tokenizer) with one
    SamplingParams for all or one per prompt. `model` is a Hugging Face Llama-style causal
    LM (engine options as LLMEngine's) or an LLMEngine to reuse. With a tokenizer, its
    end-of-sequence token is added to each request's stop tokens."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if sampling is None or isinstance(sampling, SamplingParams):
        params = [sampling or SamplingParams()] * len(prompts)
    else:
        params = list(sampling)
        if len(params) != len(prompts):
            raise EngineError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one for "
                "all or one per prompt."
            )
    if isinstance(model, LLMEngine):
        if engine_options:
            raise EngineError(
                "engine options go to LLMEngine(...) when an engine is passed, not generate."
            )
        engine = model
    else:
        if tokenizer is not None and "decode" not in engine_options:
            engine_options["decode"] = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        engine = LLMEngine(model, **engine_options)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    ids: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise EngineError(f"prompt {i} is text; pass tokenizer= or give token ids.")
            ids.append(list(tokenizer(p)["input_ids"]))
        else:
            ids.append([int(t) for t in p])
    if eos is not None:
        params = [
            p
            if eos in p.stop_token_ids
            else SamplingParams(**{**vars(p), "stop_token_ids": (*p.stop_token_ids, eos)})
            for p in params
        ]
    rids = [engine.add_request(x, p) for x, p in zip(ids, params, strict=True)]
    done: dict[str, GenerateResult] = {}
    logprobs: dict[str, list[TokenLogprob]] = {r: [] for r in rids}
    order = dict(zip(rids, range(len(rids)), strict=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in order:  # another caller's request on a shared engine
                continue
            logprobs[out.request_id] += out.new_logprobs
            if out.finished:
                done[out.request_id] = GenerateResult(
                    prompt_ids=ids[order[out.request_id]],
                    token_ids=out.token_ids,
                    text=out.text if engine.decode is not None else None,
                    finish_reason=out.finish_reason or "stop",
                    logprobs=(
                        logprobs[out.request_id]
                        if params[order[out.request_id]].logprobs is not None
                        else None
                    ),
                    num_cached_tokens=out.num_cached_tokens,
                )
    return [done[r] for r in rids]
