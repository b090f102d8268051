"""Prompt-lookup speculative decoding (opswap.llm.speculative and the engine's
verification): the proposer's matches, the sampled acceptance rule's distribution on a
tiny vocabulary, and in the engine greedy tokens with speculation identical to without
and to transformers' `generate` (Llama and GPT-2, repetitive and random prompts,
staggered arrivals, a pool small enough to preempt), drafts and acceptances counted,
blocks back to zero, speculation off above `max_batch`, log-probabilities unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from opswap.llm import (
    BlockError,
    BlockManager,
    LLMEngine,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeError,
)
from opswap.llm.sampling import sampling_probs
from opswap.llm.speculative import PromptLookup, accept_sampled, propose

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 96


def test_propose_takes_the_latest_longest_match():
    ids = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert propose(ids, 3) == [4, 5, 1]  # "1 2 3" last seen at 6
    assert propose(ids, 1) == [4]
    assert propose([5, 6, 5], 4) == [6, 5]  # the continuation may run to the end
    assert propose([1, 2, 3, 4], 2) == []  # 4 never occurred before
    assert propose([8, 1, 2, 9, 2], 2, max_ngram=3) == [9, 2]  # falls back to n = 1
    assert propose([8, 1, 2, 9, 2], 2, min_ngram=2) == []
    assert propose([3], 2) == [] and propose([3, 3], 0) == []
    # 256 then 0 hold the bytes of token 1 one byte off a token boundary: not a match
    assert propose([256, 0, 5, 1], 2, max_ngram=1) == []
    assert propose([300, 1, 5, 1], 2, max_ngram=1) == [5, 1]


def test_prompt_lookup_proposes_as_the_search_while_the_sequence_grows():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (5,), generator=g).tolist()
    lookup = PromptLookup()
    for _ in range(60):
        assert lookup.propose(ids, 3) == propose(ids, 3)
        ids.append(int(torch.randint(0, 12, (1,), generator=g)))
    assert lookup.upto == len(ids) - 2 and lookup.seen == set(ids[:-2])


def test_truncate_returns_the_blocks_only_rejected_drafts_reached():
    bm = BlockManager(num_blocks=6, block_size=4)
    ids = list(range(10))
    bm.admit("a", ids)
    bm.allocate("a", 9)  # 9 real tokens (3 blocks), then 5 drafts: 14 slots, 4 blocks
    bm.commit("a", ids, 9)  # two full blocks named
    bm.allocate("a", 14)
    assert len(bm.table("a")) == 4 and bm.num_free() == 2
    bm.truncate("a", 10)  # one draft accepted: 10 tokens keep 3 blocks
    assert len(bm.table("a")) == 3 and bm.num_free() == 3
    with pytest.raises(BlockError, match="cannot drop tokens of its blocks already in the"):
        bm.truncate("a", 4)  # the second block is named: its tokens are final
    bm.free("a")
    assert bm.stats().in_use == 0 and bm.num_free() == 6


def test_config_errors_are_one_sentence():
    with pytest.raises(SpeculativeError, match="num_tokens must be at least 1, got 0"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(SpeculativeError, match="need 1 <= min_ngram <= max_ngram"):
        SpeculativeConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(SpeculativeError, match=r"min_acceptance must be in \[0, 1\]"):
        SpeculativeConfig(min_acceptance=1.5)


@pytest.mark.parametrize("draft", [0, 2])  # a likely draft and an unlikely one
def test_sampled_acceptance_keeps_the_distribution(draft):
    """Each emitted position is distributed as plain sampling's p, whatever the draft."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.5, -0.4, 0.2, -1.0], [0.1, 1.5, 0.3, -0.5, 0.7]])
    params = SamplingParams(temperature=0.8, top_k=4)
    history = [1, 4]
    p0 = sampling_probs(logits[0], params, history)
    p1 = sampling_probs(logits[1], params, history + [draft])
    g = torch.Generator().manual_seed(3)
    n = 4000
    first = torch.zeros(5)
    second = torch.zeros(5)
    accepted = 0
    for _ in range(n):
        out = accept_sampled(logits, [draft], params, history, g)
        first[out[0]] += 1
        if out[0] == draft:
            assert len(out) == 2
            accepted += 1
            second[out[1]] += 1
        else:
            assert len(out) == 1
    assert float(first[4]) == 0.0  # top_k=4 dropped token 4 (the least likely): never drawn
    torch.testing.assert_close(first / n, p0, atol=0.025, rtol=0)
    assert accepted / n == pytest.approx(float(p0[draft]), abs=0.025)
    torch.testing.assert_close(second / accepted, p1, atol=0.04, rtol=0)


def _llama(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, intermediate_size=128, initializer_range=0.1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=96, initializer_range=0.1
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def _hf(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _prompts(seed: int = 1) -> list[list[int]]:
    """Two repetitive prompts (a phrase repeated: drafts from the prompt) and two random."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    other = torch.randint(0, VOCAB, (4,), generator=g).tolist()
    rand = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 23)]
    return [phrase * 4 + phrase[:3], rand[0], other * 5, rand[1]]


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    """One request joins before each step; the final outputs, with every streamed
    log-probability gathered in `.logprobs`."""
    pending = list(enumerate(prompts))
    got: dict[int, Any] = {}
    logprobs: dict[int, list[Any]] = {i: [] for i in range(len(prompts))}
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(p, params, str(i))
        for out in engine.step():
            logprobs[int(out.request_id)] += out.new_logprobs
            if out.finished:
                got[int(out.request_id)] = out
    for i, out in got.items():
        out.logprobs = logprobs[i]
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "kind, block_size, num_blocks", [("llama", 5, 80), ("gpt2", 3, 120), ("llama", 4, 22)]
)
def test_greedy_with_speculation_equals_without_and_transformers(kind, block_size, num_blocks):
    model = _llama() if kind == "llama" else _gpt2()
    prompts = _prompts()
    n_new = 14
    want = [_hf(model, p, n_new) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=n_new, logprobs=2)
    results = {}
    for spec in (None, SpeculativeConfig(num_tokens=4, max_batch=4)):
        engine = LLMEngine(
            model, block_size=block_size, num_blocks=num_blocks, max_model_len=48,
            max_num_seqs=4, max_num_batched_tokens=16, speculative=spec,
        )  # fmt: skip
        outs = _run(engine, prompts, params)
        assert [o.token_ids for o in outs] == want
        s = engine.stats()
        assert s.blocks.in_use == 0 and s.running == 0
        results[spec is not None] = (outs, s)
        if num_blocks == 22:  # 4 sequences of up to 41 tokens in 88 slots
            assert s.preemptions > 0
    (off, s_off), (on, s_on) = results[False], results[True]
    assert s_off.draft_tokens == 0
    assert s_on.draft_tokens > 0 and 0 < s_on.accepted_tokens <= s_on.draft_tokens
    assert s_on.steps < s_off.steps  # accepted drafts save steps
    for a, b in zip(off, on, strict=True):
        assert [lp.token for lp in a.logprobs] == [lp.token for lp in b.logprobs]
        assert len(a.logprobs) == n_new
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_speculation_is_off_above_max_batch_and_for_a_low_acceptance():
    model = _llama(seed=2)
    prompts = _prompts(seed=4)
    engine = LLMEngine(
        model, block_size=4, num_blocks=80, max_model_len=48, max_num_seqs=4,
        speculative=SpeculativeConfig(max_batch=3),
    )  # fmt: skip
    for i, p in enumerate(prompts):  # the first one finishes early
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=3 if i == 0 else 14))
    engine.step()  # all four admitted and prefilled
    while engine.has_unfinished() and len(engine.scheduler.running) == 4:
        engine.step()
        assert engine.stats().draft_tokens == 0
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().draft_tokens > 0  # on again once a request finished

    # a sequence whose drafts are all rejected pauses: min_acceptance 1 pauses after any miss
    cfg = SpeculativeConfig(min_acceptance=1.0, backoff_steps=1000)
    engine = LLMEngine(model, block_size=4, num_blocks=40, max_model_len=48, speculative=cfg)
    engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=20))
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert s.accepted_tokens < s.draft_tokens <= 2 * cfg.num_tokens


def test_sampling_with_speculation_is_seeded_and_ends_at_max_tokens():
    model = _llama(seed=1)
    prompts = _prompts(seed=2)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, seed=5)
    runs = []
    for _ in range(2):
        engine = LLMEngine(model, block_size=4, num_blocks=80, max_model_len=48, speculative=True)
        outs = _run(engine, prompts, params)
        assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
        assert engine.stats().blocks.in_use == 0
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1]


def test_a_stop_token_after_accepted_drafts_ends_the_request_there():
    """A stop token drawn in a step that also accepted drafts ends the output at it, as
    without speculation; the tokens are transformers'."""
    model = _llama()
    prompt = _prompts()[2]  # its greedy output repeats one token, then turns
    ref = _hf(model, prompt, 20)
    multi = 0
    for cut in [i for i in range(2, 20) if ref[i] not in ref[:i]]:  # first occurrences
        engine = LLMEngine(model, block_size=4, num_blocks=40, max_model_len=48, speculative=True)
        params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[cut]])
        (out,) = _run(engine, [prompt], params)
        assert out.finish_reason == "stop" and out.token_ids == ref[: cut + 1]
        assert engine.stats().blocks.in_use == 0
        multi += len(out.new_token_ids) > 1  # the last step emitted drafts and the stop
    assert multi > 0


def test_greedy_with_a_repetition_penalty_is_unchanged_by_speculation():
    """The penalty of each verified row counts the drafts accepted before it."""
    model = _llama(seed=4)
    prompts = _prompts(seed=6)
    params = SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.2)
    outs = {}
    for spec in (None, SpeculativeConfig(num_tokens=3, min_acceptance=0.0)):
        engine = LLMEngine(model, block_size=4, num_blocks=80, max_model_len=48, speculative=spec)
        outs[spec is None] = [o.token_ids for o in _run(engine, prompts, params)]
        if spec is not None:
            assert engine.stats().accepted_tokens > 0
    assert outs[True] == outs[False]
