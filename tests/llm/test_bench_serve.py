"""opswap.llm.bench_serve: the load generator against the server in process (synthetic
prompts at once and at a Poisson rate under a concurrency cap), its figures (counts,
throughputs, TTFT <= end-to-end latency, percentiles on known values, refusals counted
by status), and ShareGPT prompts read from a small file cut mid-record as the packaged
one is, with a BPE trained on them and the length filters."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from opswap.llm import LLMEngine
from opswap.llm import bench_serve as bs

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from opswap.llm.server import build_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _bench(model, reqs, **kw):
    engine = LLMEngine(model, block_size=8, num_blocks=64, max_model_len=64, max_num_seqs=4)
    app = build_app(engine, None, "tiny", max_queue=kw.pop("max_queue", 64))

    async def main():
        transport = httpx.ASGITransport(app=app)
        try:
            card = await bs.server_card("http://test", transport)
            results, seconds = await bs.run_benchmark(
                "http://test", reqs, transport=transport, model=card["id"], **kw
            )
        finally:
            await app.state.driver.shutdown(0)
        return card, results, seconds, engine.stats()

    return asyncio.run(main())


@pytest.mark.parametrize("rate, cap", [(math.inf, None), (200.0, 3)])
def test_synthetic_load_gives_sane_figures(model, rate, cap):
    reqs = bs.synthetic_requests(10, input_len=9, output_len=6, vocab=VOCAB, seed=1)
    assert all(len(r.prompt) == 9 and 3 <= min(r.prompt) for r in reqs)
    card, results, seconds, stats = _bench(model, reqs, request_rate=rate, max_concurrency=cap)
    assert card["max_model_len"] == 64 and card["vocab_size"] == VOCAB
    f = bs.summarize(results, seconds)
    assert f["completed"] == 10 and f["failed"] == 0
    assert f["total_input_tokens"] == 90 and f["total_output_tokens"] == 60  # ignore_eos
    assert f["output_throughput"] == pytest.approx(60 / seconds)
    assert f["total_token_throughput"] == pytest.approx(150 / seconds)
    assert f["request_throughput"] == pytest.approx(10 / seconds)
    for r in results:
        assert 0 < r.ttft <= r.latency <= seconds
    assert f["ttft_ms"]["median"] <= f["e2e_latency_ms"]["median"]
    assert f["tpot_ms"]["mean"] >= 0 and f["itl_ms"]["p99"] >= f["itl_ms"]["median"] >= 0
    assert stats.blocks.in_use == 0


def test_refusals_are_counted_by_status(model):
    reqs = bs.synthetic_requests(9, input_len=5, output_len=30, vocab=VOCAB)
    reqs.append(bs.BenchRequest([1] * 70, 70, 4))  # over max_model_len: a 400
    _, results, seconds, _ = _bench(model, reqs, max_queue=2)
    f = bs.summarize(results, seconds)
    assert f["failed_by_status"].get("400") == 1
    assert f["failed_by_status"].get("429", 0) == 9 - 6  # 4 running + 2 queued
    assert f["completed"] == 6 and "max_model_len" in results[-1].error


def test_percentiles_on_known_values():
    s = bs._stats([i / 1000 for i in range(1, 101)])  # 1 .. 100 ms
    assert s["mean"] == pytest.approx(50.5) and s["median"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99)
    assert bs._stats([0.003])["p99"] == pytest.approx(3)
    assert bs._stats([]) == {"mean": 0.0, "median": 0.0, "p99": 0.0}


def test_sharegpt_from_a_file_cut_mid_record(tmp_path):
    words = "the server streams tokens to clients who read them as they come".split()
    convs = []
    for i in range(60):
        human = " ".join(words[j % len(words)] for j in range(i % 7, i % 7 + 2 + i % 20))
        gpt = " ".join(words[j % len(words)] for j in range(3, 6 + 4 * (i % 11)))
        convs.append({"id": str(i), "conversations": [
            {"from": "human", "value": human}, {"from": "gpt", "value": gpt}]})  # fmt: skip
    convs.append({"id": "x", "conversations": [{"from": "human", "value": "hi"}]})
    text = json.dumps(convs, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rfind('"from": "gpt"') + 20])  # cut inside the last reply
    pairs = bs.sharegpt_pairs(path)
    assert len(pairs) == 59  # the cut record and the one-turn one are left out
    reqs, tok = bs.sharegpt_requests(20, seed=3, max_model_len=48, vocab=400, path=path)
    assert len(reqs) == 20 and len(tok) <= 400
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len >= 4
        assert r.output_len >= 4 and r.prompt_len + r.output_len <= 48
        assert max(r.prompt) < len(tok)
    with pytest.raises(bs.BenchError, match="only .* prompts that fit max_model_len 20"):
        bs.sharegpt_requests(50, max_model_len=20, vocab=400, path=path)
    with pytest.raises(bs.BenchError, match="too small for a byte-level BPE"):
        bs.sharegpt_requests(5, vocab=200, path=path)
