"""An OpenAI-compatible HTTP server over the serving engine (chapter 29): FastAPI routes,
server-sent event streaming and Prometheus metrics; `opswap serve SPEC` runs it on uvicorn.

    app = build_app(engine, tokenizer, model_name="llama")
    uvicorn.run(app, port=8000)

Routes: POST /v1/completions (a text or token-id prompt, or a list of them), POST
/v1/chat/completions (messages through the tokenizer's chat template), GET /v1/models,
/health and /metrics. The bodies are OpenAI's; `return_token_ids`, `ignore_eos`, `top_k`,
`min_p`, `repetition_penalty` and `stop_token_ids` are the usual extensions (vLLM's).

Refusals: a bad request gets 400 and {"error": {"message": one sentence, "type":
"invalid_request_error"}}; a server holding max_num_seqs running and max_queue queued
requests answers 429; one shutting down, 503. A client that goes away (a closed stream,
a cancelled call) has its request aborted in the engine before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from opswap.llm.driver import Delta, EngineDriver, Observer, Overloaded, ShuttingDown
from opswap.llm.engine import LLMEngine
from opswap.llm.metrics import ServerMetrics
from opswap.llm.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    Prepared,
    chat_logprobs,
    choice_logprobs,
    prepare_chat,
    prepare_completion,
)


def build_app(
    engine: LLMEngine,
    tokenizer: Any = None,
    model_name: str = "opswap",
    max_queue: int = 64,
    max_num_seqs: int | None = None,
    eos_token_id: int | None = None,
    grace_s: float = 5.0,
) -> Any:
    """The FastAPI app serving `engine`. Without a tokenizer the server takes token-id
    prompts only and its choices carry `token_ids` (their text is empty). `eos_token_id`
    (default: the tokenizer's) ends a generation unless a request sets ignore_eos.
    Shutting down (the app's lifespan) waits up to `grace_s` seconds for requests in
    flight, then aborts the rest."""
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    metrics = ServerMetrics(engine.num_blocks)
    driver = EngineDriver(
        engine,
        tokenizer,
        max_queue=max_queue,
        max_num_seqs=max_num_seqs,
        observer=Observer(on_finish=metrics.finished, on_step=metrics.step),
    )
    created = int(time.time())
    vocab = _vocab_size(engine)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        await driver.shutdown(grace_s)

    app = FastAPI(title="opswap serve", lifespan=lifespan)
    app.state.driver = driver
    app.state.metrics = metrics

    error = _error
    answer = _Responder(driver, tokenizer, model_name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        return error(400, _validation_sentence(exc.errors()))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> Any:
        return error(exc.status, str(exc))

    @app.exception_handler(Overloaded)
    async def _full(request: Request, exc: Overloaded) -> Any:
        return error(429, str(exc), "rate_limit_error")

    @app.exception_handler(ShuttingDown)
    async def _closing(request: Request, exc: ShuttingDown) -> Any:
        return error(503, str(exc), "server_error")

    ctx = dict(
        tokenizer=tokenizer,
        model_name=model_name,
        max_model_len=engine.max_model_len,
        vocab=vocab,
        eos=eos_token_id,
    )

    @app.get("/health")
    async def health() -> Any:
        if driver.error is not None:
            return error(503, driver.error, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "opswap",
            "max_model_len": engine.max_model_len,
            "vocab_size": vocab,
            "has_tokenizer": tokenizer is not None,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Any:
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        prepared = prepare_completion(body, **ctx)
        return await answer.serve(prepared, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        prepared = prepare_chat(body, **ctx)
        return await answer.serve(prepared, request, chat=True)

    return app


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Any:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class _Responder:
    """Turns a prepared request into the engine's requests and their deltas into an
    OpenAI body or a stream of chunks."""

    def __init__(self, driver: EngineDriver, tokenizer: Any, model_name: str) -> None:
        self.driver, self.tokenizer, self.model_name = driver, tokenizer, model_name

    async def serve(self, p: Prepared, request: Request, chat: bool) -> Any:
        """The response to one prepared request: a JSON body, or an SSE stream."""
        driver = self.driver
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        reqs = []
        try:
            for i, ids in enumerate(p.prompts):
                reqs.append(driver.submit(ids, p.params, p.stop, queue, i))
        except (Overloaded, ShuttingDown):
            for r in reqs:
                driver.abort(r.request_id)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if p.stream:
            events = self.stream(p, reqs, queue, rid, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        watch = asyncio.create_task(_watch(request.is_disconnected, queue))
        try:
            result = await self.collect(p, reqs, queue, rid, chat)
        finally:
            watch.cancel()
            for r in reqs:
                driver.abort(r.request_id)  # nothing when it finished; frees it when not
        if isinstance(result, Delta):
            kind = "invalid_request_error" if result.status == 400 else "server_error"
            return _error(result.status, result.error or "the request failed.", kind)
        return result

    async def collect(
        self, p: Prepared, reqs: list[Any], queue: asyncio.Queue[Delta], rid: str, chat: bool
    ) -> dict[str, Any] | Delta:
        """The whole answer of a non-streamed request, or the Delta that failed it."""
        tokenizer, model_name = self.tokenizer, self.model_name
        n = len(reqs)
        ids: list[list[int]] = [[] for _ in range(n)]
        text = [""] * n
        logprobs: list[list[Any]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        while any(r is None for r in reasons):
            d = await queue.get()
            if d.error is not None:
                return d
            ids[d.index] += d.token_ids
            text[d.index] += d.text
            logprobs[d.index] += d.logprobs
            reasons[d.index] = d.finish_reason
        choices = []
        for i in range(n):
            c: dict[str, Any] = {"index": i}
            if chat:
                c["message"] = {"role": "assistant", "content": text[i]}
                c["logprobs"] = chat_logprobs(logprobs[i], tokenizer) if p.logprobs else None
            else:
                c["text"] = text[i]
                c["logprobs"] = choice_logprobs(logprobs[i], tokenizer) if p.logprobs else None
            c["finish_reason"] = reasons[i]
            if p.return_token_ids:
                c["prompt_token_ids"] = p.prompts[i]
                c["token_ids"] = ids[i]
            choices.append(c)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(p, sum(len(x) for x in ids)),
        }

    async def stream(
        self, p: Prepared, reqs: list[Any], queue: asyncio.Queue[Delta], rid: str, chat: bool
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed request; its requests are aborted when the
        client goes away (the generator is cancelled)."""
        tokenizer, model_name, driver = self.tokenizer, self.model_name, self.driver
        kind = "chat.completion.chunk" if chat else "text_completion"
        stamp = int(time.time())
        left, generated = len(reqs), 0

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {"id": rid, "object": kind, "created": stamp, "model": model_name}
            return f"data: {json.dumps({**body, 'choices': choices, **extra})}\n\n"

        try:
            if chat:
                for i in range(len(reqs)):
                    first = {"role": "assistant", "content": ""}
                    yield chunk([{"index": i, "delta": first, "logprobs": None}])
            while left:
                d = await queue.get()
                if d.error is not None:
                    kind = "invalid_request_error" if d.status == 400 else "server_error"
                    err = {"message": d.error, "type": kind, "code": d.status}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    break
                generated += len(d.token_ids)
                if d.finish_reason is not None:
                    left -= 1
                elif not d.token_ids and not d.text:
                    continue
                c: dict[str, Any] = {"index": d.index}
                if chat:
                    c["delta"] = {"content": d.text} if d.text or not d.finish_reason else {}
                    lp = chat_logprobs(d.logprobs, tokenizer) if p.logprobs else None
                else:
                    c["text"] = d.text
                    lp = choice_logprobs(d.logprobs, tokenizer) if p.logprobs else None
                c["logprobs"] = lp
                c["finish_reason"] = d.finish_reason
                if p.return_token_ids:
                    c["token_ids"] = d.token_ids
                yield chunk([c])
            else:
                if p.include_usage:
                    yield chunk([], usage=_usage(p, generated))
                yield "data: [DONE]\n\n"
        finally:  # the client closed the stream (this generator was cancelled) or done
            for r in reqs:
                driver.abort(r.request_id)


async def _watch(gone: Callable[[], Awaitable[bool]], queue: asyncio.Queue[Delta]) -> None:
    """Every half second, whether a non-streamed call's client has gone: then an error on
    its queue ends the wait, and the handler aborts its requests."""
    while not await gone():
        await asyncio.sleep(0.5)
    queue.put_nowait(Delta(0, [], "", [], error="the client disconnected."))


def _vocab_size(engine: LLMEngine) -> int | None:
    """The model's vocabulary size, for the 400 on an out-of-range token (None: unknown,
    and the engine's own check answers)."""
    size = getattr(getattr(engine, "runner", None), "vocab", None)  # every ModelRunner's
    return int(size) if size else None


def _usage(p: Prepared, generated: int) -> dict[str, int]:
    prompt = sum(len(x) for x in p.prompts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


#: what the fields of several types take, said once rather than per type pydantic tried
_UNIONS = {
    "prompt": "a text, a list of token ids, or a list of texts or of token-id lists",
    "stop": "a string or a list of strings",
}


def _validation_sentence(errors: Any) -> str:
    """One sentence for pydantic's first complaint about a request body."""
    if not errors:
        return "the request body is not valid."
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if loc and loc[0] in _UNIONS and e.get("type") != "missing":
        return f"field '{loc[0]}' must be {_UNIONS[loc[0]]}."
    msg = str(e.get("msg", "is not valid")).rstrip(".")
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON."
    if e.get("type") == "missing":
        return f"the request lacks the field '{'.'.join(loc)}'."
    where = f"field '{'.'.join(loc)}'" if loc else "the request body"
    return f"{where}: {msg[:1].lower() + msg[1:]}."


class ServerThread:
    """A uvicorn server for `app` on a thread of this process (tests, examples, the
    benchmark): `with ServerThread(app) as url: ...` serves at `url` (a free loopback
    port unless given) and shuts down gracefully on leaving."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0
    ) -> None:
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=max(1, round(grace_s)),
        )
        self.server = uvicorn.Server(config)
        self.thread: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        import threading

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.perf_counter() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.perf_counter() > end:
                raise OSError(f"the server did not start on {self.url}.")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
