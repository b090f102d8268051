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


def test_opswap_max_time_s_caps_every_timing_loop(monkeypatch):
    """OPSWAP_MAX_TIME_S stops a loop that would time on for its own max_time_s (the
    simulated clock: 0.1 s a round of two functions)."""

    def rounds() -> int:
        monkeypatch.setattr(timing, "_Timer", busy(seed=3))
        res = timing.benchmark(
            {"a": _work, "b": _work}, warmup=1, repeats=3, min_time_s=5.0, max_time_s=8.0
        )
        return len(res.rounds)

    monkeypatch.delenv("OPSWAP_MAX_TIME_S", raising=False)
    uncapped = rounds()
    monkeypatch.setenv("OPSWAP_MAX_TIME_S", "0.5")
    capped = rounds()
    assert uncapped >= 45 and 3 <= capped <= 7, (uncapped, capped)


def test_a_bad_opswap_max_time_s_is_one_sentence(monkeypatch):
    import pytest

    from opswap.errors import OpswapError

    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("OPSWAP_MAX_TIME_S", bad)
        with pytest.raises(OpswapError, match="OPSWAP_MAX_TIME_S must be a positive number"):
            timing.benchmark({"f": _work})
    monkeypatch.setenv("OPSWAP_MAX_TIME_S", " ")
    assert timing.time_cap() is None
