"""opswap.llm.server on a tiny random Llama (float32, CPU) with a BPE tokenizer trained
here: completions streamed and not give the tokens of `opswap.llm.generate` (greedy),
for text and token-id prompts and several prompts in one request; return_token_ids;
chat through the tokenizer's template; stop strings cut the text; logprobs; 400s with
one sentence (bad temperature, n=2, text without a tokenizer, a prompt over the limit
naming it, a wrong type, no chat template), 404 for another model, 429 over the queue
bound; a client that disconnects mid-stream has its blocks freed; shutdown aborts what
is left; /metrics names its series; and one load test of `opswap serve hf:llama` in its
own process: ~120 requests of mixed lengths, some cancelled mid-stream, under a time
limit, then each completed one again alone."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from opswap.llm import LLMEngine, SamplingParams, generate
from opswap.llm.driver import EngineDriver
from opswap.llm.tokenizer import train_tokenizer

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from opswap.llm.server import build_app, free_port  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "A server streams tokens to many clients; each one reads its own deltas.",
    "Grüße aus Köln: naïve café, 東京 and 🙂 are characters of several bytes.",
] * 2
MAX_LEN = 96


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, 300)


@pytest.fixture(scope="module")
def model(tok):
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=len(tok), initializer_range=0.1,
        max_position_embeddings=MAX_LEN,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _engine(model, **kw):
    opts = dict(block_size=8, num_blocks=96, max_model_len=MAX_LEN, max_num_seqs=4)
    return LLMEngine(model, **{**opts, **kw})


def _run(app, fn):
    """Run `fn(client)` against the app in process, then shut its driver down."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            try:
                return await fn(c)
            finally:
                await app.state.driver.shutdown(0)

    return asyncio.run(main())


def _events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _greedy(model, tok, prompts, n):
    res = generate(
        model, prompts, SamplingParams(temperature=0, max_tokens=n), tokenizer=tok,
        block_size=8, num_blocks=96, max_model_len=MAX_LEN,
    )  # fmt: skip
    return [r.token_ids for r in res]


def test_completions_streamed_and_not_give_generates_tokens(model, tok):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, len(tok), (11,), generator=g).tolist()
    text = "The quick brown fox"
    want = _greedy(model, tok, [text, ids], 12)
    app = build_app(_engine(model), tok, "tiny")

    async def fn(c):
        body = dict(max_tokens=12, temperature=0, return_token_ids=True)
        a = (await c.post("/v1/completions", json={**body, "prompt": text})).json()
        b = (await c.post("/v1/completions", json={**body, "prompt": ids})).json()
        both = await c.post("/v1/completions", json={**body, "prompt": [text, ids]})
        s = await c.post(
            "/v1/completions",
            json={**body, "prompt": ids, "stream": True, "stream_options": {"include_usage": True}},
        )
        return a, b, both.json(), s.text

    a, b, both, streamed = _run(app, fn)
    assert a["object"] == "text_completion" and a["model"] == "tiny"
    assert a["choices"][0]["token_ids"] == want[0]
    assert a["choices"][0]["prompt_token_ids"] == tok(text)["input_ids"]
    assert b["choices"][0]["token_ids"] == want[1]
    assert [c["token_ids"] for c in both["choices"]] == want
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert b["choices"][0]["text"] == tok.decode(want[1], skip_special_tokens=True)
    assert b["usage"] == dict(
        prompt_tokens=11, completion_tokens=len(want[1]), total_tokens=11 + len(want[1])
    )
    events = _events(streamed)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"] == b["usage"]
    assert sum((e["choices"][0]["token_ids"] for e in chunks), []) == want[1]
    assert "".join(e["choices"][0]["text"] for e in chunks) == b["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in chunks][-1] == b["choices"][0][
        "finish_reason"
    ]
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])


def test_chat_uses_the_template_streamed_and_not(model, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    (want,) = _greedy(model, tok, [ids], 9)
    app = build_app(_engine(model), tok, "tiny")

    async def fn(c):
        body = dict(messages=messages, max_tokens=9, temperature=0, return_token_ids=True)
        r = (await c.post("/v1/chat/completions", json=body)).json()
        s = await c.post("/v1/chat/completions", json={**body, "stream": True})
        return r, s.text

    r, streamed = _run(app, fn)
    assert r["object"] == "chat.completion"
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want
    assert choice["message"] == {
        "role": "assistant",
        "content": tok.decode(want, skip_special_tokens=True),
    }
    events = _events(streamed)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert content == choice["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_stop_strings_cut_the_text_and_logprobs_come_per_token(model, tok):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, len(tok), (7,), generator=g).tolist()
    (full,) = _greedy(model, tok, [ids], 24)
    whole = tok.decode(full, skip_special_tokens=True)
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    app = build_app(_engine(model), tok, "tiny")

    async def fn(c):
        body = dict(prompt=ids, max_tokens=24, temperature=0, return_token_ids=True)
        r = (await c.post("/v1/completions", json={**body, "stop": [stop]})).json()
        s = await c.post("/v1/completions", json={**body, "stop": stop, "stream": True})
        lp = (await c.post("/v1/completions", json={**body, "logprobs": 2})).json()
        return r, s.text, lp

    r, streamed, lp = _run(app, fn)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == whole[: whole.find(stop)]
    assert choice["token_ids"] == full[: len(choice["token_ids"])]
    text = "".join(e["choices"][0]["text"] for e in _events(streamed)[:-1])
    assert text == choice["text"]
    logprobs = lp["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(full)
    assert all(x <= 0 for x in logprobs["token_logprobs"])
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])


BAD = [
    ({"prompt": "hi", "temperature": -1}, "temperature must be >= 0"),
    ({"prompt": "hi", "n": 2}, "n must be 1"),
    ({"prompt": [5] * MAX_LEN}, f"at most {MAX_LEN} tokens in all"),
    ({"prompt": "hi", "temperature": "hot"}, "field 'temperature'"),
    ({"prompt": 3}, "field 'prompt' must be a text, a list of token ids"),
    ({"max_tokens": 3}, "lacks the field 'prompt'"),
    ({"prompt": [5, 9999]}, "outside the model's vocabulary"),
    ({"prompt": "hi", "echo": True}, "echo is not supported"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs must be None or 0 to 20"),
]


def test_bad_requests_get_400_with_one_sentence(model, tok):
    untemplated = train_tokenizer(TEXTS, 300, chat_template=None)

    async def fn(c):
        out = [await c.post("/v1/completions", json=body) for body, _ in BAD]
        out.append(await c.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"}))
        return out

    responses = _run(build_app(_engine(model), tok, "tiny"), fn)
    for r, (_, words) in zip(responses, BAD, strict=False):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and words in err["message"], err
        assert err["message"].endswith(".") and "\n" not in err["message"]
    assert responses[-1].status_code == 404 and "'gpt-9' does not exist" in responses[-1].text
    assert f"may have at most {MAX_LEN - 1}" in responses[2].json()["error"]["message"]

    async def bare(c):
        text = await c.post("/v1/completions", json={"prompt": "hi"})
        chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
        ok = await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        return text, chat, ok

    text, chat, ok = _run(build_app(_engine(model), None, "tiny"), bare)
    assert text.status_code == 400 and "token-id prompts only" in text.json()["error"]["message"]
    assert chat.status_code == 400 and "no tokenizer" in chat.json()["error"]["message"]
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2

    async def chat_fn(c):
        msg = {"messages": [{"role": "user", "content": "hi"}]}
        return await c.post("/v1/chat/completions", json=msg)

    r = _run(build_app(_engine(model), untemplated, "tiny"), chat_fn)
    assert r.status_code == 400 and "has no chat template" in r.json()["error"]["message"]


def test_over_the_queue_bound_requests_get_429(model, tok):
    app = build_app(_engine(model, max_num_seqs=1), tok, "tiny", max_queue=2)
    body = {"prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0}

    async def fn(c):
        return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(5)])

    codes = [r.status_code for r in _run(app, fn)]
    assert codes.count(200) == 3 and codes.count(429) == 2, codes
    assert app.state.driver.stats.blocks.in_use == 0


async def _asgi_stream_then_disconnect(app, body: dict, chunks_before: int) -> list[bytes]:
    """POST `body` to the ASGI app and disconnect after `chunks_before` body chunks, as a
    client closing its stream does (httpx's ASGITransport would buffer the whole body)."""
    got: list[bytes] = []
    enough = asyncio.Event()
    if chunks_before == 0:
        enough.set()
    raw = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await enough.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            got.append(message["body"])
            if len(got) >= chunks_before:
                enough.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("test", 80),
    }  # fmt: skip
    await app(scope, receive, send)
    return got


def test_a_client_gone_mid_stream_frees_its_blocks(model, tok):
    engine = _engine(model)
    app = build_app(engine, tok, "tiny")
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 80, "temperature": 0, "stream": True}

    async def main():
        got = await _asgi_stream_then_disconnect(app, body, 3)
        driver = app.state.driver
        for _ in range(500):
            if not driver.requests and driver.stats.blocks.in_use == 0 and not driver._inbox:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        await driver.shutdown(0)
        return got, stats

    got, stats = asyncio.run(main())
    assert 3 <= len(got) < 20
    # aborted at once: far fewer than the 4 + 80 tokens a finished request computes
    assert stats.tokens_computed < 4 + 20, stats.tokens_computed
    assert stats.blocks.in_use == 0 and stats.running == 0 and stats.waiting == 0


def test_a_client_gone_before_a_plain_answer_frees_its_blocks(model, tok):
    engine = _engine(model)
    app = build_app(engine, tok, "tiny")
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 80, "temperature": 0}

    async def main():
        got = await _asgi_stream_then_disconnect(app, body, 0)
        driver = app.state.driver
        for _ in range(500):
            if not driver._inbox and driver.stats.blocks.in_use == 0:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        await driver.shutdown(0)
        return got, stats

    got, stats = asyncio.run(main())
    assert b"the client disconnected" in b"".join(got)
    assert stats.blocks.in_use == 0 and stats.tokens_computed < 4 + 20, stats


def test_shutdown_aborts_what_is_left_after_the_grace_period(model, tok):
    engine = _engine(model)

    async def main():
        driver = EngineDriver(engine, tok)
        req = driver.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=80))
        first = await req.queue.get()
        await driver.shutdown(0)
        rest = []
        while not req.queue.empty():
            rest.append(req.queue.get_nowait())
        return first, rest, driver

    first, rest, driver = asyncio.run(main())
    assert first.finish_reason is None and rest[-1].finish_reason == "abort"
    assert engine.stats().blocks.in_use == 0 and not engine.has_unfinished()
    assert not driver.accepting


def test_metrics_name_their_series(model, tok):
    app = build_app(_engine(model), tok, "tiny")

    async def fn(c):
        await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4})
        return (await c.get("/metrics")).text, (await c.get("/health")), await c.get("/v1/models")

    text, health, models = _run(app, fn)
    for name in (
        "opswap_requests_waiting", "opswap_requests_running", "opswap_kv_blocks_in_use 0.0",
        "opswap_kv_blocks_total 96.0", "opswap_generation_tokens_per_second",
        "opswap_prompt_tokens_total 2.0", "opswap_generation_tokens_total 4.0",
        'opswap_requests_finished_total{finish_reason="length"} 1.0',
        "opswap_time_to_first_token_seconds_count 1.0",
        "opswap_time_per_output_token_seconds_count 1.0",
        "opswap_e2e_request_latency_seconds_count 1.0",
    ):  # fmt: skip
        assert name in text, name
    assert health.json() == {"status": "ok"}
    card = models.json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == MAX_LEN


def _metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def test_opswap_serve_hf_llama_under_load(tmp_path):
    """`opswap serve hf:llama` in its own process (uvicorn on loopback): ~120 streamed
    requests of mixed lengths at once, every 10th closed after its third chunk, a queue
    bound that refuses some: each ends with a status, the KV blocks in use return to 0,
    every completed greedy result equals the same request sent alone afterwards, a
    non-streamed request gives the streamed tokens, and SIGTERM stops it cleanly."""
    port = free_port()
    cmd = [sys.executable, "-m", "opswap.cli", "serve", "hf:llama", "--port", str(port),
           "--device", "cpu", "--block-size", "8", "--max-num-seqs", "8",
           "--max-num-batched-tokens", "64", "--max-queue", "90"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.1)
        _check_load(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert f"serving hf:llama as 'llama' at {url}/v1" in out and "stopped" in out


def _check_load(url: str) -> None:
    rng = random.Random(7)
    card = httpx.get(url + "/v1/models").json()["data"][0]
    vocab, max_len = card["vocab_size"], card["max_model_len"]
    assert card["id"] == "llama" and not card["has_tokenizer"]
    reqs = []
    for i in range(120):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        reqs.append((prompt, rng.randrange(1, 24), i % 10 == 3))

    async def one(c, prompt, n, cancel):
        body = dict(prompt=prompt, max_tokens=n, temperature=0, stream=True, ignore_eos=True)
        ids: list[int] = []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, None
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ids += choice["token_ids"]  # a server without a tokenizer sends them
                chunks += 1
                if choice["finish_reason"]:
                    assert choice["finish_reason"] == "length"
                    return 200, ids
                if cancel and chunks == 3:
                    return 499, ids  # leaving the block closes the stream
        return 0, ids  # the stream ended without a finish reason

    async def load():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*[one(c, *r) for r in reqs])

    t0 = time.perf_counter()
    results = asyncio.run(load())
    assert time.perf_counter() - t0 < 60
    codes = [code for code, _ in results]
    assert set(codes) <= {200, 429, 499}, codes
    assert codes.count(200) >= 60 and codes.count(429) >= 1 and codes.count(499) >= 5, codes
    for _ in range(200):
        metrics = httpx.get(url + "/metrics").text
        if _metric(metrics, "opswap_requests_running") == 0:
            break
        time.sleep(0.02)
    assert _metric(metrics, "opswap_kv_blocks_in_use") == 0
    assert _metric(metrics, "opswap_requests_waiting") == 0
    aborted = 'opswap_requests_finished_total{finish_reason="abort"}'
    # a cancelled request may have finished on the server before its client left
    assert 1 <= _metric(metrics, aborted) <= codes.count(499)
    done = [(r, ids) for r, (code, ids) in zip(reqs, results, strict=True) if code == 200]
    with httpx.Client(base_url=url, timeout=60) as c:
        for (prompt, n, _), ids in done:
            assert len(ids) == n
            body = dict(prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True)
            alone = c.post("/v1/completions", json=body).json()
            assert alone["choices"][0]["token_ids"] == ids
        long = c.post("/v1/completions", json={"prompt": [5] * max_len})
        assert long.status_code == 400 and f"at most {max_len} tokens" in long.text


def _cli(*args: str) -> int:
    from opswap.cli import main

    try:
        main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_serve_refuses_a_kv_budget_naming_the_largest_max_model_len(capfd):
    # hf:llama: 2 layers, 2 KV heads of 16 in float32: 8 KiB a block of 16 tokens
    assert _cli("serve", "hf:llama", "--device", "cpu", "--kv-memory", "40KiB") == 2
    err = capfd.readouterr().err
    assert "--kv-memory 40KiB holds 5 KV blocks of 16 tokens" in err
    assert "less than one sequence of --max-model-len 128" in err
    assert "use --max-model-len 80 or less" in err and "Traceback" not in err
    assert _cli("serve", "hf:llama", "--kv-memory", "lots") == 2
    assert "--kv-memory takes a size such as 2GiB" in capfd.readouterr().err
    assert _cli("bench-serve", "http://127.0.0.1:9", "--dataset", "mine") == 2
    assert "--dataset must be sharegpt or synthetic" in capfd.readouterr().err


def test_a_request_the_engine_refuses_gets_400_streamed_or_not(model, tok, monkeypatch):
    import opswap.llm.server as server

    monkeypatch.setattr(server, "_vocab_size", lambda engine: None)  # skip the server's check
    app = build_app(_engine(model), tok, "tiny")

    async def fn(c):
        body = {"prompt": [5, 10**6], "max_tokens": 3}
        plain = await c.post("/v1/completions", json=body)
        streamed = await c.post("/v1/completions", json={**body, "stream": True})
        return plain, streamed.text

    plain, streamed = _run(app, fn)
    assert plain.status_code == 400
    assert "outside the model's vocabulary of" in plain.json()["error"]["message"]
    (event,) = _events(streamed)
    assert event["error"]["code"] == 400 and "vocabulary" in event["error"]["message"]


def test_an_engine_failure_answers_500_and_health_503(model, tok, monkeypatch):
    engine = _engine(model)

    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", boom)
    app = build_app(engine, tok, "tiny")

    async def fn(c):
        r = await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        return r, await c.get("/health"), await c.post("/v1/completions", json={"prompt": [5]})

    r, health, after = _run(app, fn)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "the engine failed (RuntimeError: boom)."
    assert health.status_code == 503 and after.status_code == 503
    assert "boom), so the server takes no requests." in after.json()["error"]["message"]


def test_an_hf_checkpoint_directory_brings_its_tokenizer(tok, model, tmp_path):
    from opswap.cli.serve import find_tokenizer

    model.save_pretrained(tmp_path)
    assert find_tokenizer(f"hf:{tmp_path}", None) is None  # weights only: no tokenizer
    tok.save_pretrained(tmp_path)
    found = find_tokenizer(f"hf:{tmp_path}", None)
    assert found("naïve café")["input_ids"] == tok("naïve café")["input_ids"]
    assert found.chat_template == tok.chat_template
    assert find_tokenizer("hf:llama", None) is None
    assert find_tokenizer("hf:llama", tmp_path) is not None
