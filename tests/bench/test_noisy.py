"""The busy-machine timer: functions still run, the load of each run and the jitter of each
sample show in the times, and the simulated clock decides when timing stops."""

from __future__ import annotations

import time

from opswap.bench import timing
from opswap.bench.noisy import busy


def _work() -> int:
    return sum(i * i for i in range(2000))


def test_a_busy_machine_runs_the_functions_and_never_settles(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "_Timer", busy(seed=1))
    t0 = time.perf_counter()
    res = timing.benchmark(
        {"a": lambda: calls.append(_work()), "b": _work},
        warmup=1,
        repeats=15,
        min_time_s=0.5,
        max_time_s=8.0,
        rel_width=0.1,
    )
    took = time.perf_counter() - t0
    assert calls and res.settled is False  # half the samples 20x slower: no narrow interval
    lo, hi = timing.bootstrap_ratio([r["a"] for r in res.rounds], [r["b"] for r in res.rounds])
    assert hi - lo > 0.1 * res.ratio("a", "b").of_medians
    assert took < 8.0  # stopped by the simulated clock, not the real one


def test_each_run_gets_its_own_load(monkeypatch):
    monkeypatch.setattr(timing, "_Timer", busy(seed=2, load=(5.0, 1.0), jitter=((1.0, 1.0),)))
    first = timing.benchmark({"f": _work}, warmup=1, repeats=9, min_time_s=0.0)
    second = timing.benchmark({"f": _work}, warmup=1, repeats=9, min_time_s=0.0)
    assert first["f"].median > 2.5 * second["f"].median
