"""The tuning database and the learned cost model (chapter 25), measured on this machine.

    PYTHONPATH=src python benchmarks/bench_tuning.py [--out DIR] [--convs N] [--linears N]
                                                     [--seed S] [--threads T]

1. Second run: zoo:resnet planned twice with conv.algorithm and precision.int8_linear
   (the rules that time sites on a CPU) against one fresh tuning database, each run with
   a new timer as a new process would have: the site timings each run made, the
   database's outcomes, and the seconds the second run spent in database lookups.
2. Cost model: one-layer models at random shapes (N convolutions raced by
   conv.algorithm: PyTorch's conv in NCHW and channels-last, im2col, FFT, Winograd; N
   Linears timed by precision.int8_linear: float32 against int8), each planned once
   through the same path with its own database records. The sites are split 75/25 by
   site; LightGBM trees trained on the first part predict the held-out part's times.
   Reported: Spearman's rank correlation of predicted and measured seconds over every
   held-out (site, candidate), the same for the roofline's prediction (the peer: what the
   planner predicts without a model), the mean correlation within each held-out site of
   three candidates or more, and how often the model's first pick is the measured fastest.

Each figure is one timing per site (bench.timing.fastest: the fastest of interleaved
rounds over 0.1-1 s), as the planner makes them. Writes DIR/tuning_cpu.json.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402

from opswap.bench.device import describe_device  # noqa: E402
from opswap.bench.timing import with_timer  # noqa: E402
from opswap.graph.capture import capture  # noqa: E402
from opswap.models import load  # noqa: E402
from opswap.planner import make_plan  # noqa: E402
from opswap.targets import get_target  # noqa: E402
from opswap.tuning import TunedTimer, TuningDB  # noqa: E402
from opswap.tuning import costmodel as cm  # noqa: E402

RULES = "conv.algorithm,precision.int8_linear"


def _timer(db: Path) -> TunedTimer:
    t = with_timer(get_target("cpu"), str(db)).timer
    assert isinstance(t, TunedTimer)
    return t


def second_run(db: Path) -> dict[str, Any]:
    loaded = load("zoo:resnet")
    runs = []
    for _ in range(2):
        cap = capture(loaded.module, loaded.example_inputs, dynamic="none")
        target = with_timer(get_target("cpu"), str(db))
        timer = target.timer
        assert isinstance(timer, TunedTimer) and timer.db is not None
        spent = [0.0]
        get = timer.db.get

        def timed_get(*a: Any, get: Any = get, spent: list[float] = spent, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return get(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        timer.db.get = timed_get  # type: ignore[method-assign]
        t0 = time.perf_counter()
        make_plan(cap, target=target, rules=RULES, exactness="approx")
        s = timer.summary()
        runs.append(
            {
                "plan_s": round(time.perf_counter() - t0, 3),
                "timings_made": s["timings_made"],
                "hits": s["hits"],
                "near": s["near"],
                "misses": s["misses"],
                "lookup_s": round(spent[0], 4),
            }
        )
    return {"model": "zoo:resnet", "rules": RULES, "first": runs[0], "second": runs[1]}


class _Conv(nn.Module):
    def __init__(self, c: int, o: int, k: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, o, k, stride=stride, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def dataset(db: Path, convs: int, linears: int, seed: int) -> None:
    rng = random.Random(seed)
    target = get_target("cpu")
    for i in range(convs + linears):
        torch.manual_seed(i)
        if i < convs:
            c, o = rng.choice([3, 8, 16, 24, 32, 48, 64]), rng.choice([8, 16, 32, 48, 64])
            k, stride = rng.choice([1, 3, 3, 3, 5]), rng.choice([1, 1, 2])
            hw, n = rng.randint(8, 48), rng.choice([1, 2, 4, 8])
            model: nn.Module = _Conv(c, o, k, stride).eval()
            x = torch.randn(n, c, hw, hw)
            rules = "conv.algorithm"
        else:
            m, k_, n_ = rng.randint(1, 256), rng.randint(16, 1024), rng.randint(16, 1024)
            model = nn.Sequential(nn.Linear(k_, n_)).eval()
            x = torch.randn(m, k_)
            rules = "precision.int8_linear"
        cap = capture(model, (x,), dynamic="none")
        t = with_timer(target, str(db))
        make_plan(cap, target=t, rules=rules, exactness="approx")
        if (i + 1) % 25 == 0:
            print(f"  {i + 1} sites timed", flush=True)


def evaluate(db: Path, seed: int) -> dict[str, Any]:
    records = [
        r
        for r in TuningDB(db).records("site-time")
        if isinstance(r.value, dict) and r.value.get("features")
    ]
    rng = random.Random(seed)
    rng.shuffle(records)
    cut = int(0.75 * len(records))
    train, held = records[:cut], records[cut:]

    def rows(recs: list[Any]) -> list[cm.Row]:
        return [
            cm.Row(r.value["features"], n, float(s))
            for r in recs
            for n, s in r.value["times"].items()
            if math.isfinite(s) and s > 0
        ]

    t0 = time.perf_counter()
    model = cm.CostModel.train(rows(train))
    train_s = time.perf_counter() - t0
    test = rows(held)
    predicted = [model.predict(r.features, [r.candidate])[0] for r in test]
    measured = [r.seconds for r in test]
    roofline = [math.exp(r.features["log_roofline_s"]) for r in test]
    within, first_right, sites = [], 0, 0
    for r in held:
        times = {n: s for n, s in r.value["times"].items() if math.isfinite(s)}
        if len(times) < 2:
            continue
        sites += 1
        names = list(times)
        guess = model.predict(r.value["features"], names)
        first_right += names[min(range(len(names)), key=lambda i: guess[i])] == min(
            times, key=lambda n: times[n]
        )
        if len(names) >= 3:
            rho = cm.spearman(guess, [times[n] for n in names])
            if not math.isnan(rho):
                within.append(rho)
    return {
        "train_sites": len(train),
        "held_out_sites": len(held),
        "train_rows": len(rows(train)),
        "held_out_rows": len(test),
        "train_s": round(train_s, 3),
        "spearman_held_out": round(cm.spearman(predicted, measured), 4),
        "spearman_roofline_held_out": round(cm.spearman(roofline, measured), 4),
        "spearman_within_site_mean": round(statistics.mean(within), 4) if within else None,
        "within_site_count": len(within),
        "first_pick_right": f"{first_right}/{sites}",
    }


#: what the JSON says of peers: the second run has none to time beside it
PEER = (
    "second_run: none; it counts the timings a second plan skips and the seconds its "
    "database lookups take, opswap's own bookkeeping, which no other tool does for these "
    "rules. cost_model: the roofline's prediction, the planner's without a model, scored "
    "on the same held-out sites (spearman_roofline_held_out)."
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--convs", type=int, default=150)
    p.add_argument("--linears", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tuning-"))
    t0 = time.perf_counter()
    again = second_run(tmp / "second.sqlite")
    print("second run:", again, flush=True)
    dataset(tmp / "data.sqlite", args.convs, args.linears, args.seed)
    model = evaluate(tmp / "data.sqlite", args.seed)
    print("cost model:", model, flush=True)
    write_results(
        args.out,
        "tuning_cpu.json",
        describe_device("cpu"),
        [{"part": "second_run", **again}, {"part": "cost_model", **model}],
        lightgbm=_version("lightgbm"),
        peer=PEER,
        threads=args.threads,
        convs=args.convs,
        linears=args.linears,
        seed=args.seed,
        wall_s=round(time.perf_counter() - t0, 1),
    )


def _version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


if __name__ == "__main__":
    main()
