"""The async side of the serving engine (chapter 29): one task owns the engine, requests
reach it through an inbox, and each request reads its token deltas from its own queue.

    driver = EngineDriver(engine, tokenizer, max_queue=64)
    req = driver.submit(prompt_ids, SamplingParams(max_tokens=32), stop=["\\n"])
    while (delta := await req.queue.get()).finish_reason is None:
        send(delta.text)
    driver.abort(req.request_id)       # a client gone: its blocks go back at once

The engine is not thread-safe, so every call to it (add_request, abort, step, stats)
is made by the driver's loop: `submit` and `abort` only put an entry in the inbox and wake
the loop, which applies the inbox between steps. The step itself runs on one worker
thread (under inference mode) so that the event loop keeps answering HTTP while the
model computes; the loop awaits it, so nothing else touches the engine meanwhile.

Text is made here, not in the engine: each request has an `IncrementalDetokenizer`, and
stop strings are matched on its text; when one appears the request is aborted in the
engine at once (its text cut before the string, finish reason "stop"). Streamed text
holds back the last characters that could begin a stop string.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from opswap.errors import OpswapError
from opswap.llm.detok import IncrementalDetokenizer
from opswap.llm.engine import EngineStats, LLMEngine, RequestOutput
from opswap.llm.sampling import SamplingParams, TokenLogprob


class Overloaded(OpswapError):
    """The server holds as many requests as it takes: running and queued."""


class ShuttingDown(OpswapError):
    """The server is shutting down and takes no new request."""


@dataclass
class Delta:
    """What a request gained in one step; `finish_reason` set on its last delta.
    `error` is set (and nothing else) when the engine failed."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500  # of the error: 400 when the engine refused the request


@dataclass
class Request:
    """One generation in flight: its queue of Deltas and what the metrics need."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    queue: asyncio.Queue[Delta]
    index: int = 0
    detok: IncrementalDetokenizer | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # all the text made so far (stop strings matched on it)
    sent: int = 0  # how much of it was sent
    finish_reason: str | None = None


@dataclass
class Observer:
    """Callbacks the metrics hang on (all optional): a finished request, a step's stats
    and generated tokens."""

    on_finish: Callable[[Request, float], None] | None = None
    on_step: Callable[[EngineStats, int, float], None] | None = None


class EngineDriver:
    """Runs an LLMEngine for many concurrent asyncio callers (see the module docstring).

    At most `max_num_seqs + max_queue` requests are held; `submit` beyond that raises
    Overloaded (a server's 429). `max_num_seqs` defaults to the engine scheduler's.
    """

    def __init__(
        self,
        engine: LLMEngine,
        tokenizer: Any = None,
        max_queue: int = 64,
        max_num_seqs: int | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_num_seqs = (
            max_num_seqs if max_num_seqs is not None else engine.scheduler.max_num_seqs
        )
        self.max_queue = max_queue
        self.observer = observer or Observer()
        self.requests: dict[str, Request] = {}
        self.stats: EngineStats = engine.stats()
        self.error: str | None = None
        self.accepting = True
        self._inbox: list[tuple[str, Request | str]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._executor: ThreadPoolExecutor | None = None

    # -- callers (any task of the event loop) ---------------------------------------------

    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_queue

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        queue: asyncio.Queue[Delta] | None = None,
        index: int = 0,
    ) -> Request:
        """Queue a request for the engine; its Deltas arrive on `queue` (a new one unless
        given: several requests may share one, told apart by `index`)."""
        if self.error is not None:
            raise ShuttingDown(f"{self.error.rstrip('.')}, so the server takes no requests.")
        if not self.accepting:
            raise ShuttingDown("the server is shutting down and takes no new requests.")
        if len(self.requests) >= self.capacity:
            raise Overloaded(
                f"the server is at capacity ({self.max_num_seqs} running and "
                f"{self.max_queue} queued requests); retry later."
            )
        self._start()
        rid = f"r{next(self._ids)}"
        req = Request(
            request_id=rid,
            prompt_ids=[int(t) for t in prompt_ids],
            params=params,
            stop=tuple(stop),
            queue=queue if queue is not None else asyncio.Queue(),
            index=index,
        )
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)
        self.requests[rid] = req
        self._post("add", req)
        return req

    def abort(self, request_id: str) -> None:
        """Drop a request (its caller is gone); the engine frees its blocks before its next
        step. Nothing more is sent to its queue."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._post("abort", request_id)
            req.finish_reason = "abort"
            if self.observer.on_finish is not None:
                self.observer.on_finish(req, time.perf_counter())

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Take no new request, let those in flight finish for up to `grace_s` seconds,
        then abort the rest (their callers get finish reason "abort") and stop the loop."""
        self.accepting = False
        end = time.perf_counter() + grace_s
        while self.requests and time.perf_counter() < end and self.error is None:
            await asyncio.sleep(0.01)
        for req in list(self.requests.values()):
            self._finish(req, "abort")
            self._post("abort", req.request_id)
        if self._task is not None:
            while self._inbox and not self._task.done():
                await asyncio.sleep(0.001)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- the loop (the only caller of the engine) ----------------------------------------

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._executor = self._executor or ThreadPoolExecutor(1, "opswap-engine")
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _post(self, op: str, what: Request | str) -> None:
        self._inbox.append((op, what))
        if self._wake is not None:
            self._wake.set()

    def _step(self) -> list[RequestOutput]:
        with torch.inference_mode():
            return self.engine.step()

    async def _run(self) -> None:
        assert self._wake is not None and self._executor is not None
        loop = asyncio.get_running_loop()
        while True:
            self._apply_inbox()
            if not self.engine.has_unfinished():
                self._observe(0, 0.0)
                self._wake.clear()
                if not self._inbox:
                    await self._wake.wait()
                continue
            t0 = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._executor, self._step)
            except OpswapError as e:  # already a sentence (a tensor-parallel rank failed)
                self._fail(str(e))
                return
            except Exception as e:  # a bug or an out-of-memory: fail what is in flight
                self._fail(f"the engine failed ({type(e).__name__}: {e}).")
                return
            self._observe(self._dispatch(outputs), time.perf_counter() - t0)

    def _apply_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for op, what in inbox:
            if op == "add":
                assert isinstance(what, Request)
                if what.request_id not in self.requests:
                    continue  # aborted before it reached the engine
                try:
                    self.engine.add_request(what.prompt_ids, what.params, what.request_id)
                except OpswapError as e:  # the server checks first; this is a last guard
                    self.requests.pop(what.request_id, None)
                    refused = Delta(what.index, [], "", [], error=str(e), status=400)
                    what.queue.put_nowait(refused)
            else:
                assert isinstance(what, str)
                self.engine.abort(what)

    def _observe(self, generated: int, seconds: float) -> None:
        self.stats = self.engine.stats()
        if self.observer.on_step is not None:
            self.observer.on_step(self.stats, generated, seconds)

    def _dispatch(self, outputs: list[RequestOutput]) -> int:
        now = time.perf_counter()
        generated = 0
        for out in outputs:
            generated += len(out.new_token_ids)
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # its caller left; the abort is in the inbox
            if req.first_token is None and out.new_token_ids:
                req.first_token = now
            req.output_ids += out.new_token_ids
            stopped = self._add_text(req, out.new_token_ids, out.finished)
            if stopped:
                self.engine.abort(req.request_id)
            end = len(req.text)
            if not (out.finished or stopped) and req.stop:
                end = max(req.sent, end - max(len(s) for s in req.stop) + 1)
            delta = Delta(req.index, out.new_token_ids, req.text[req.sent : end], out.new_logprobs)
            req.sent = end
            if out.finished or stopped:
                delta.finish_reason = "stop" if stopped else (out.finish_reason or "stop")
                self._finish(req, delta.finish_reason, delta)
            else:
                req.queue.put_nowait(delta)
        return generated

    def _add_text(self, req: Request, new_ids: list[int], finished: bool) -> bool:
        """Extend req.text; True (and the text cut) when a stop string appeared."""
        if req.detok is None:
            return False
        visible = [t for t in new_ids if t not in req.params.stop_token_ids]
        before = len(req.text)
        req.text += req.detok.push(visible)
        if finished:
            req.text += req.detok.flush()
        for s in req.stop:
            at = req.text.find(s, max(0, before - len(s) + 1))
            if at >= 0:
                req.text = req.text[:at]
                return True
        return False

    def _finish(self, req: Request, reason: str, last: Delta | None = None) -> None:
        self.requests.pop(req.request_id, None)
        req.finish_reason = reason
        if last is None:
            last = Delta(req.index, [], req.text[req.sent :], [], reason)
            req.sent = len(req.text)
        req.queue.put_nowait(last)
        if self.observer.on_finish is not None:
            self.observer.on_finish(req, time.perf_counter())

    def _fail(self, message: str) -> None:
        self.error = message
        self.accepting = False
        for req in list(self.requests.values()):
            self.requests.pop(req.request_id, None)
            req.queue.put_nowait(Delta(req.index, [], "", [], error=message))
