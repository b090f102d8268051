import copy
import json

import pytest
import torch
from torch import nn

from opswap.bench.compare import bench_models
from opswap.bench.timing import BenchResult, Stats, benchmark, resolve_device
from opswap.errors import OpswapError


def _work(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


def test_structure_and_fast_functions_get_many_inner_calls():
    res = benchmark(
        {"a": lambda: None, "b": lambda: _work(10)}, warmup=1, repeats=4, min_time_s=0.0
    )
    assert set(res.stats) == {"a", "b"} and len(res.rounds) >= 4
    for s in res.stats.values():
        assert s.n == len(res.rounds) and s.inner > 10  # a no-op is far below 1 ms
        assert 0 < s.min <= s.median and s.iqr >= 0 and s.q1 <= s.q3
    assert res.device.startswith("cpu: ") and "thread" in res.device
    data = json.loads(json.dumps(res.to_json()))
    assert set(data["stats"]["a"]) >= {"median_ms", "iqr_ms", "min_ms", "mean_ms", "n", "inner"}


def test_rounds_are_interleaved_and_rotated():
    log: list[str] = []
    fns = {name: (lambda name=name: log.append(name)) for name in ("x", "y", "z")}
    res = benchmark(fns, warmup=2, repeats=6, min_time_s=0.0, target_sample_s=0.0)
    assert res.order[:4] == [["x", "y", "z"], ["y", "z", "x"], ["z", "x", "y"], ["x", "y", "z"]]
    # the calls really happened in that order: the tail of the log is the timed rounds
    timed = [n for order in res.order for n in order for _ in range(res[n].inner)]
    assert log[-len(timed) :] == timed
    # warm-up came first, also interleaved
    assert log[:6] == ["x", "y", "z", "y", "z", "x"]


def test_ten_times_the_work_gets_a_higher_median():
    # ten times, not three: on a busy 2-core machine single samples of the lighter call
    # were seen at 4.8x each other (48 and 230 us), enough to flip a 3x difference
    res = benchmark(
        {"once": lambda: _work(2000), "tenfold": lambda: _work(20000)},
        warmup=1,
        repeats=7,
        min_time_s=0.0,
    )
    assert res["tenfold"].median > res["once"].median
    r = res.ratio("tenfold", "once")
    assert r.paired > 1.0 and r.of_medians > 1.0 and r.n == len(res.rounds)


def test_ratio_arithmetic():
    rounds = [{"a": 2.0, "b": 1.0}, {"a": 3.0, "b": 1.0}, {"a": 8.0, "b": 2.0}]
    stats = {k: Stats(k, [r[k] for r in rounds], 1) for k in "ab"}
    res = BenchResult(stats, rounds, [["a", "b"]] * 3, "cpu", 0)
    r = res.ratio("a", "b")
    assert r.paired == 3.0  # median of 2, 3, 4
    assert r.of_medians == 3.0 / 1.0
    assert res.ratio("b", "a").paired == pytest.approx(1 / 3)
    assert stats["a"].median == 3.0 and stats["a"].mean == pytest.approx(13 / 3)
    assert stats["a"].median_s == 3.0 and stats["a"].median_ms == 3000.0


def test_min_time_adds_rounds_and_max_time_stops_them():
    res = benchmark(
        {"f": lambda: _work(100)}, warmup=0, repeats=2, min_time_s=0.05, target_sample_s=1e-3
    )
    assert len(res.rounds) > 2
    res = benchmark(
        {"f": lambda: _work(100)}, warmup=0, repeats=1000, min_time_s=0.0, max_time_s=0.0
    )
    assert len(res.rounds) == 3


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(torch.relu(self.fc(x)))


def test_bench_models_report():
    m = Small().train()
    before = copy.deepcopy(m.state_dict())
    b = bench_models(
        m, copy.deepcopy(m), (torch.randn(8, 32),), warmup=1, repeats=3, min_time_s=0.0
    )
    data = json.loads(json.dumps(b.to_json()))
    for key in ("ref_ms", "opt_ms", "speedup", "device", "torch", "spread", "rounds"):
        assert key in data
    assert data["ref_ms"] > 0 and data["opt_ms"] > 0 and data["speedup"] > 0
    assert data["device"].startswith("cpu") and data["torch"] == torch.__version__
    assert data["ref_peak_bytes"] >= 8 * 64 * 4  # at least the output
    assert m.training  # mode restored, weights untouched
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert "speedup" in str(b)


def test_bench_models_runs_in_inference_mode():
    seen = []

    def probe(x):
        seen.append(torch.is_inference_mode_enabled())
        return x * 2

    bench_models(probe, probe, torch.randn(4), warmup=1, repeats=2, min_time_s=0.0, memory=False)
    assert seen and all(seen)


def test_devices():
    with pytest.raises(OpswapError):
        benchmark({})
    with pytest.raises(OpswapError, match="Unknown device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(OpswapError, match="no GPU"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_timing():
    a = torch.randn(1024, 1024, device="cuda")
    res = benchmark(
        {"mm": lambda: a @ a, "mm3": lambda: (a @ a, a @ a, a @ a)},
        device="cuda",
        repeats=5,
        min_time_s=0.0,
    )
    assert res.device.startswith("cuda: ")
    assert res["mm3"].median > res["mm"].median


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bench_models_and_moved_copy():
    m = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3)).eval()
    x = torch.randn(4, 3, 64, 64)
    b = bench_models(m, m, (x,), device="cuda", warmup=2, repeats=5, min_time_s=0.0)
    assert b.device.startswith("cuda: ") and b.ref_ms > 0 and b.speedup > 0
    assert b.ref_peak_bytes and b.ref_peak_bytes >= 4 * 32 * 62 * 62 * 4
    assert any("copied" in n for n in b.notes)
    assert next(m.parameters()).device.type == "cpu"  # the user's model stays where it was


def test_rel_width_keeps_timing_until_the_interval_is_narrow_or_time_is_up():
    import time as _time

    fns = {"a": lambda: sum(range(200)), "b": lambda: sum(range(300))}
    # no minimum time: the plain run stops at `repeats` rounds, the loose one at the first
    # interval check past them (every 10 rounds), whatever the machine's load
    loose = benchmark(
        fns,
        warmup=1,
        repeats=15,
        min_time_s=0.0,
        max_time_s=5.0,
        rel_width=100.0,
        target_sample_s=1e-4,
    )
    plain = benchmark(
        fns, warmup=1, repeats=15, min_time_s=0.0, max_time_s=5.0, target_sample_s=1e-4
    )
    assert len(plain.rounds) == 15 and plain.settled is None
    assert len(loose.rounds) == 20 and loose.settled is True
    t0 = _time.perf_counter()
    tight = benchmark(
        fns,
        warmup=1,
        repeats=15,
        min_time_s=0.05,
        max_time_s=0.6,
        rel_width=1e-12,
        target_sample_s=1e-4,
    )
    took = _time.perf_counter() - t0
    assert took >= 0.6 and len(tight.rounds) > len(loose.rounds)  # ran to the cap, not further
    assert took < 5.0


def test_with_timer_gives_a_cpu_target_the_cpu_timer_and_a_gpu_profile_none_without_its_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opswap.bench.timing import with_timer
    from opswap.targets import get_target
    from opswap.tuning import TunedTimer

    cpu = with_timer(get_target("cpu"))
    assert isinstance(cpu.timer, TunedTimer) and cpu.timer.kind == "cpu"
    times = cpu.timer({"a": lambda: sum(range(50)), "b": lambda: None})
    assert set(times) == {"a", "b"} and all(t > 0 for t in times.values())
    assert with_timer(cpu) is cpu  # a timer already set is kept
    # on a machine without CUDA, a GPU profile is a datasheet: estimate only
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert with_timer(get_target("h100")).timer is None
    # with a GPU of the profile's class it gets CUDA events; of another class, nothing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    gpu = with_timer(get_target("h200"), "off")
    assert isinstance(gpu.timer, TunedTimer) and gpu.timer.kind == "cuda" and gpu.timer.db is None
    assert with_timer(get_target("a100")).timer is None
