"""opswap.llm.LLMEngine and generate on tiny random Llama, Qwen2 and Mistral models in
float32 against transformers' `generate(do_sample=False)`: prompts of lengths 1, 5, 17
and 40 arriving at different steps, block sizes that divide none of them, chunked
prefill, and a pool small enough to preempt (tokens still identical); the same tokens
alone and in a busy batch, greedy and seeded; prefix caching (hits counted, tokens
unchanged); blocks back to zero after finishing and after abort; stop tokens and stop
strings; streamed deltas; log-probabilities against HF's logits; one-sentence errors; the CUDA-graph bucket path
(padded inputs run eagerly on the CPU; captured graphs on a GPU, skipped without one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from opswap.errors import OpswapError
from opswap.llm import EngineError, LLMEngine, SamplingParams, generate

transformers = pytest.importorskip("transformers")

# small ops on 2 threads stall whenever another process holds a core (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = (1, 5, 17, 40)
N_NEW = 10
VOCAB = 160


def _model(kind: str = "llama", seed: int = 0):
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        intermediate_size=128,
        initializer_range=0.1,  # livelier logits than 0.02: greedy paths that do not loop
    )
    cls, cfg = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
    }[kind]
    torch.manual_seed(seed)
    return cls(cfg(**common)).eval()


def _prompts(lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _hf(model, prompt: list[int], n: int = N_NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _staggered(engine: LLMEngine, prompts, params) -> dict[int, list[int]]:
    """One request joins before each step; returns request index -> output tokens."""
    pending = list(enumerate(prompts))
    got: dict[int, list[int]] = {}
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(p, params[i] if isinstance(params, list) else params, str(i))
        for out in engine.step():
            if out.finished:
                got[int(out.request_id)] = out.token_ids
    return got


@pytest.mark.parametrize(
    "kind, block_size, num_blocks",
    [("llama", 5, 64), ("qwen2", 4, 64), ("mistral", 4, 64), ("llama", 4, 15)],
)
def test_greedy_tokens_equal_transformers_with_staggered_arrivals(kind, block_size, num_blocks):
    model = _model(kind)
    prompts = _prompts()
    want = [_hf(model, p) for p in prompts]
    engine = LLMEngine(
        model, block_size=block_size, num_blocks=num_blocks, max_model_len=56,
        max_num_seqs=4, max_num_batched_tokens=16,
    )  # fmt: skip
    got = _staggered(engine, prompts, SamplingParams(temperature=0, max_tokens=N_NEW))
    assert [got[i] for i in range(len(prompts))] == want
    s = engine.stats()
    if num_blocks == 15:  # 4 sequences of up to 50 tokens in 60 slots: someone is preempted
        assert s.preemptions > 0
    assert s.blocks.in_use == 0 and s.running == 0 and s.waiting == 0
    # chunked: the 40-token prompt cannot pass in one step of 16 tokens
    assert s.steps > N_NEW + 2


def test_the_same_request_alone_and_in_a_busy_batch():
    model = _model("llama", seed=3)
    prompts = _prompts((9, 3, 22, 14, 6), seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=8, seed=11)
    opts = dict(block_size=4, num_blocks=80, max_model_len=48, max_num_batched_tokens=12)
    for params in (greedy, seeded):
        alone = generate(model, [prompts[2]], params, **opts)[0].token_ids
        noisy = [SamplingParams(temperature=1.1, max_tokens=5 + i) for i in range(5)]
        noisy[2] = params
        busy = generate(model, prompts, noisy, **opts)[2].token_ids
        assert alone == busy and len(alone) == 8
    other_seed = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=8, seed=12)
    assert generate(model, [prompts[2]], other_seed, **opts)[0].token_ids != alone


def test_prefix_caching_reuses_three_blocks_and_keeps_the_tokens():
    model = _model("qwen2", seed=2)
    bs = 5
    shared = _prompts((3 * bs,), seed=8)[0]
    a, b = shared + [1, 2, 3], shared + [9, 8]
    params = SamplingParams(temperature=0, max_tokens=6)
    results = {}
    for caching in (True, False):
        engine = LLMEngine(
            model, block_size=bs, num_blocks=40, max_model_len=40, prefix_caching=caching
        )
        first = generate(engine, [a], params)[0]
        second = generate(engine, [b], params)[0]
        results[caching] = (first.token_ids, second.token_ids)
        s = engine.stats().blocks
        if caching:
            assert second.num_cached_tokens == 3 * bs
            assert s.hit_blocks == 3 and s.hit_rate == pytest.approx(3 / 6)
        else:
            assert second.num_cached_tokens == 0 and s.hit_blocks == 0
        assert s.in_use == 0
    assert results[True] == results[False]
    assert results[True][1] == _hf(model, b, 6)


def test_prompts_admitted_in_the_same_step_share_their_prefix():
    model = _model("llama", seed=5)
    bs = 4
    shared = _prompts((3 * bs,), seed=4)[0]
    prompts = [shared + [5, 6, 7], shared + [8], shared + [1, 2, 3, 4, 5, 6]]
    params = SamplingParams(temperature=0, max_tokens=5)
    engine = LLMEngine(model, block_size=bs, num_blocks=40, max_model_len=40)
    res = generate(engine, prompts, params)
    assert engine.stats().steps == 5  # all three prefilled in the first step
    assert [r.num_cached_tokens for r in res] == [0, 3 * bs, 3 * bs]
    assert [r.token_ids for r in res] == [_hf(model, p, 5) for p in prompts]


def test_blocks_return_to_zero_after_abort_and_aborts_finish_with_abort():
    model = _model("llama")
    engine = LLMEngine(model, block_size=4, num_blocks=40, max_model_len=64)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30, seed=1)) for p in _prompts()]
    for _ in range(3):
        engine.step()
    assert engine.stats().blocks.in_use > 0
    out = engine.abort(ids[1])
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort(ids[1]) is None and engine.abort("nobody") is None
    for rid in (ids[0], ids[2], ids[3]):
        engine.abort(rid)
    assert not engine.has_unfinished() and engine.stats().blocks.in_use == 0
    assert engine.step() == []


def _letters(ids) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_tokens_stop_strings_and_streamed_deltas():
    model = _model("mistral", seed=4)
    prompt = _prompts((7,), seed=9)[0]
    ref = _hf(model, prompt, 12)
    engine = LLMEngine(model, block_size=4, num_blocks=30, max_model_len=40, decode=_letters)
    # stop at the first occurrence of the ref's 5th token
    stop_tok = ref[4]
    cut = ref.index(stop_tok) + 1
    rid = engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok])
    )
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    last = outs[-1]
    assert last.finish_reason == "stop" and last.token_ids == ref[:cut]
    assert [t for o in outs for t in o.new_token_ids] == ref[:cut]
    assert last.text == _letters(ref[: cut - 1])  # the stop token is not in the text

    text = _letters(ref)
    stop_str = text[6:8]
    at = text.find(stop_str)
    rid = engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop_str, "zzzz"])
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "stop" and outs[-1].text == text[:at]
    assert "".join(o.new_text for o in outs) == text[:at]
    assert engine.stats().blocks.in_use == 0

    # a character whose bytes are not all there yet is not streamed until they are
    engine.decode = lambda ids: _letters(ids) + ("\ufffd" if len(ids) % 2 else "")
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=5))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert all("\ufffd" not in o.new_text for o in outs[:-1])
    assert "".join(o.new_text for o in outs) == _letters(ref[:5]) + "\ufffd"
    engine.decode = _letters

    done = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert done.finish_reason == "length" and done.token_ids == ref[:3]


def test_max_model_len_ends_a_request_with_length():
    model = _model("llama")
    prompt = _prompts((10,))[0]
    out = generate(
        model,
        [prompt],
        SamplingParams(temperature=0, max_tokens=50),
        block_size=4,
        max_model_len=14,
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.token_ids == _hf(model, prompt, 4)


def test_logprobs_are_hf_log_softmax():
    model = _model("qwen2", seed=6)
    prompt = _prompts((6,), seed=2)[0]
    out = generate(
        model, [prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3), block_size=4
    )[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    for i, entry in enumerate(out.logprobs):
        row = lp[len(prompt) - 1 + i]
        assert entry.token == out.token_ids[i]
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


class _Tok:
    """A tokenizer stand-in: one letter a token, end token 3."""

    eos_token_id = 3

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) - ord("a") + 4 for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t - 4 + ord("a")) for t in ids if t != 3 and 4 <= t < 30)


def test_generate_with_text_prompts_stops_at_the_tokenizers_end_token():
    model = _model("llama", seed=1)
    with torch.no_grad():  # make token 3 the certain next token after any 'c'
        model.lm_head.weight[3] = 0.0
    res = generate(
        model,
        ["abc", "hello"],
        SamplingParams(temperature=0, max_tokens=5),
        tokenizer=_Tok(),
        block_size=4,
    )
    assert [r.prompt_ids for r in res] == [[4, 5, 6], [11, 8, 15, 15, 18]]
    for r in res:
        assert r.text is not None and r.finish_reason in ("stop", "length")
        assert (3 in r.token_ids) == (r.finish_reason == "stop")


def test_errors_are_one_sentence():
    model = _model("llama")
    with pytest.raises(EngineError, match=r"use max_model_len <= 40 or more KV memory"):
        LLMEngine(model, block_size=4, num_blocks=10, max_model_len=64)
    with pytest.raises(EngineError, match="kv_memory of 100 bytes holds no KV block"):
        LLMEngine(model, kv_memory=100, max_model_len=16)
    with pytest.raises(EngineError, match="give num_blocks or kv_memory, not both"):
        LLMEngine(model, num_blocks=10, kv_memory=10**6, max_model_len=16)
    engine = LLMEngine(model, block_size=4, kv_memory=2 * 2 * 4 * 2 * 16 * 4 * 10, max_model_len=40)
    assert engine.num_blocks == 10
    with pytest.raises(EngineError, match="has 41 tokens, more than max_model_len 40"):
        engine.add_request(list(range(41)))
    with pytest.raises(EngineError, match="stop strings need text"):
        engine.add_request([1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(EngineError, match="outside the model's vocabulary of 160"):
        engine.add_request([1, 500])
    with pytest.raises(EngineError, match="empty prompt"):
        engine.add_request([])
    engine.add_request([1], request_id="x")
    with pytest.raises(EngineError, match="request id 'x' is already in use"):
        engine.add_request([2], request_id="x")
    with pytest.raises(EngineError, match="got 1 SamplingParams for 2 prompts"):
        generate(model, [[1], [2]], [SamplingParams()], max_model_len=16)
    with pytest.raises(EngineError, match="prompt 0 is text; pass tokenizer="):
        generate(model, ["hi"], max_model_len=16)
    with pytest.raises(EngineError, match="max_num_seqs must be at least 1, got 0"):
        LLMEngine(model, max_num_seqs=0, max_model_len=16)
    with pytest.raises(OpswapError, match="GPT2LMHeadModel.*; Linear has another layout"):
        LLMEngine(torch.nn.Linear(4, 4), max_model_len=16)


def _padded_run(
    model: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    device: str,
    graphs: str,
    **opts: Any,
) -> tuple[list[list[int]], dict[int, list], LLMEngine]:
    """Outputs of a staggered run; graphs: 'off', 'eager' (the bucket path with padded
    static buffers, run eagerly: any device) or 'capture' (CUDA graphs)."""
    from opswap.llm.engine import _DecodeGraphs

    engine = LLMEngine(model, device=device, cuda_graphs=graphs == "capture", **opts)
    if graphs == "eager":
        engine.graphs = _DecodeGraphs(engine, 8, capture=False)
    outs = {}
    logprobs: dict[int, list] = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(p, params, str(i))
        for out in engine.step():
            logprobs[int(out.request_id)] += out.new_logprobs
            if out.finished:
                outs[int(out.request_id)] = out.token_ids
    return [outs[i] for i in range(len(prompts))], logprobs, engine


def _same_logprobs(a: dict[int, list], b: dict[int, list], tol: float) -> None:
    for i in a:
        assert [x.token for x in a[i]] == [y.token for y in b[i]]
        for x, y in zip(a[i], b[i], strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=tol)


def test_bucketed_decode_padding_is_exact_on_the_cpu():
    """The graph path's inputs (padded to a bucket, padded rows on the spare block) run
    eagerly give the tokens of the plain path; 3 decodes ran in the bucket of 4."""
    model = _model("llama", seed=7)
    prompts = _prompts((3, 9, 14), seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    opts = dict(block_size=4, num_blocks=40, max_model_len=32)
    want, lp_want, _ = _padded_run(model, prompts, params, "cpu", "off", **opts)
    got, lp_got, engine = _padded_run(model, prompts, params, "cpu", "eager", **opts)
    assert got == want == [_hf(model, p, 8) for p in prompts]
    _same_logprobs(lp_want, lp_got, 1e-4)
    assert engine.stats().blocks.in_use == 0
    spare = engine.k_cache[:, engine.num_blocks]
    assert spare.abs().sum() > 0  # the padded rows wrote there, and only there
    with pytest.raises(EngineError, match="cuda_graphs=True needs a CUDA device"):
        LLMEngine(model, max_model_len=16, cuda_graphs=True)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_cuda
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cuda_graph_tokens_equal_eager(kind):
    model = _model(kind, seed=8).cuda()
    prompts = _prompts((2, 7, 19, 33, 5), seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    opts = dict(block_size=16, num_blocks=64, max_model_len=64, max_num_seqs=8)
    want, lp_want, _ = _padded_run(model, prompts, params, "cuda", "off", **opts)
    got, lp_got, engine = _padded_run(model, prompts, params, "cuda", "capture", **opts)
    assert got == want
    _same_logprobs(lp_want, lp_got, 1e-3)
    s = engine.stats()
    assert s.graph_steps > 0 and s.blocks.in_use == 0
    assert engine.graphs is not None and set(engine.graphs.graphs) <= {1, 2, 4, 8}
    assert 8 in engine.graphs.graphs  # 5 decodes ran in the bucket of 8


@needs_cuda
def test_cuda_graphs_with_speculation_and_bucket_reuse():
    """Steps with drafts run eagerly, decode-only ones replay; a bucket captured once
    serves later batches of other sizes and contexts (tokens still equal)."""
    from opswap.llm import SpeculativeConfig

    model = _model("llama", seed=9).cuda()
    prompts = [p * 3 for p in _prompts((4, 6, 3), seed=2)]
    params = SamplingParams(temperature=0, max_tokens=16)
    opts = dict(block_size=8, num_blocks=48, max_model_len=64, max_num_seqs=4)
    spec = SpeculativeConfig(num_tokens=3, max_batch=2)
    want, _, _ = _padded_run(model, prompts, params, "cuda", "off", **opts)
    got, _, engine = _padded_run(
        model, prompts, params, "cuda", "capture", speculative=spec, **opts
    )
    assert got == want
    s = engine.stats()
    assert s.graph_steps > 0 and s.draft_tokens > 0 and s.blocks.in_use == 0
