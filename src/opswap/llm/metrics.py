"""The server's Prometheus metrics (chapter 29), in a registry of its own per app.

Gauges: opswap_requests_waiting, opswap_requests_running, opswap_kv_blocks_in_use,
opswap_kv_blocks_total, opswap_generation_tokens_per_second (over the last few seconds of
steps). Counters: opswap_prompt_tokens_total, opswap_generation_tokens_total,
opswap_requests_finished_total{finish_reason}. Histograms (seconds):
opswap_time_to_first_token_seconds, opswap_time_per_output_token_seconds,
opswap_e2e_request_latency_seconds.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from opswap.llm.engine import EngineStats

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

#: seconds of steps the tokens/s gauge averages over
WINDOW_S = 5.0


class ServerMetrics:
    def __init__(self, num_blocks: int) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            disable_created_metrics,
        )

        disable_created_metrics()  # no *_created series beside every counter

        self.registry = r = CollectorRegistry()
        self.waiting = Gauge("opswap_requests_waiting", "Requests queued", registry=r)
        self.running = Gauge("opswap_requests_running", "Requests in the batch", registry=r)
        self.blocks_in_use = Gauge("opswap_kv_blocks_in_use", "KV blocks held", registry=r)
        self.blocks_total = Gauge("opswap_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.tokens_per_s = Gauge(
            "opswap_generation_tokens_per_second",
            f"Tokens generated per second over the last {WINDOW_S:g} s",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "opswap_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("opswap_generation_tokens", "Tokens generated", registry=r)
        self.finished_requests = Counter(
            "opswap_requests_finished", "Requests finished", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "opswap_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "opswap_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            buckets=_PER_TOKEN,
            registry=r,
        )
        self.e2e = Histogram(
            "opswap_e2e_request_latency_seconds",
            "Arrival to the last token",
            buckets=_LATENCY,
            registry=r,
        )
        self.blocks_total.set(num_blocks)
        self._recent: deque[tuple[float, int]] = deque()

    def step(self, stats: EngineStats, generated: int, seconds: float) -> None:
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.blocks_in_use.set(stats.blocks.in_use)
        self.generation_tokens.inc(generated)
        now = time.perf_counter()
        self._recent.append((now, generated))
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()
        span = now - self._recent[0][0] + seconds if self._recent else 0.0
        total = sum(n for _, n in self._recent)
        self.tokens_per_s.set(total / span if span > 0 else 0.0)

    def finished(self, req: Any, now: float) -> None:
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.finished_requests.labels(req.finish_reason or "abort").inc()
        if req.first_token is None:
            return
        self.ttft.observe(req.first_token - req.arrived)
        self.e2e.observe(now - req.arrived)
        if len(req.output_ids) > 1:
            self.tpot.observe((now - req.first_token) / (len(req.output_ids) - 1))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
