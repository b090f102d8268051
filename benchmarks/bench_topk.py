"""Top-k (chapter 17): opswap::topk (Triton) against torch.topk and torch.compile of it on
the GPU, over the grid k in {1..1024} x n in {128, 1000, 4096, 32768, 131072} x rows in
{1, 16, 256, 4096} x {float32, bfloat16} (k <= n: 460 cases), checking the values are
identical in every case; and, on any device, the exact rewrite topk.sort_slice (a full sort
cut to [:k] against torch.topk) and the bucketed approximate top-k with its recall.

    python benchmarks/bench_topk.py                      # CUDA: the grid, writes topk_CARD.json
    python benchmarks/bench_topk.py --update-crossover   # ... and rewrites the crossover table
    python benchmarks/bench_topk.py --smoke              # CPU: a small grid, topk_cpu.json

Times are medians over interleaved repetitions (CUDA events on the GPU), after warm-up.
The summary gives the geometric mean of torch.topk's time over ours across the grid and
across the classes ours wins (the only ones topk.topk takes: kernels/crossover.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from _results import write_results  # noqa: E402

from opswap.kernels import crossover  # noqa: E402
from opswap.kernels import topk as T  # noqa: E402

RESULTS = Path(__file__).parent / "results"
KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
NS = (128, 1000, 4096, 32768, 131072)
ROWS = (1, 16, 256, 4096)
DTYPES = (torch.float32, torch.bfloat16)


def _time(fns: dict, device: str, reps: int) -> dict[str, float]:
    """Median ms of each callable, the callables interleaved rep by rep."""
    for f in fns.values():  # warm-up (and compile)
        f()
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                torch.cuda.synchronize()
                times[k].append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def grid(device: str, smoke: bool) -> list[dict]:
    rows_out = []
    ks, ns, rows_, dtypes = (
        ((1, 8, 64), (128, 1000, 4096), (1, 16, 256), (torch.float32,))
        if smoke
        else (KS, NS, ROWS, DTYPES)
    )
    compiled = torch.compile(lambda x, k: torch.topk(x, k), dynamic=True) if not smoke else None
    for dt in dtypes:
        for n in ns:
            for rows in rows_:
                x = torch.randn(rows, n, device=device).to(dt)
                for k in ks:
                    if k > n:
                        continue
                    v, _ = T.topk(x, k, True, True)
                    identical = bool(torch.equal(v, torch.topk(x, k)[0]))
                    fns = {
                        "ours": lambda x=x, k=k: T.topk(x, k, True, True),
                        "eager": lambda x=x, k=k: torch.topk(x, k),
                        "sort_slice": lambda x=x, k=k: torch.sort(x, -1, True)[0][:, :k],
                    }
                    if compiled is not None:
                        fns["compile"] = lambda x=x, k=k: compiled(x, k)
                    t = _time(fns, device, 5 if smoke else 20)
                    rows_out.append(
                        {
                            "kernel": "topk",
                            "dtype": str(dt).removeprefix("torch."),
                            "shape": T.shape_class(n, k, rows),
                            "pass": "forward",
                            "n": n,
                            "k": k,
                            "rows": rows,
                            "path": T.path(n, k),
                            "identical": identical,
                            "ours_ms": t["ours"],
                            "eager_ms": t["eager"],
                            "compile_ms": t.get("compile"),
                            "sort_slice_ms": t["sort_slice"],
                        }
                    )
                    print(rows_out[-1], flush=True)
    return rows_out


def approx_rows(device: str) -> list[dict]:
    out = []
    for n, k in ((4096, 16), (32768, 64), (131072, 128)):
        x = torch.randn(256, n, device=device)
        b, kp = T.buckets_for(n, k)
        _, got = T.approx_topk(x, k, True, b, kp)
        _, want = torch.topk(x, k)
        hit = torch.zeros_like(x, dtype=torch.bool).scatter_(1, want, True).gather(1, got)
        t = _time(
            {
                "approx": lambda x=x, k=k, b=b, kp=kp: T.approx_topk(x, k, True, b, kp),
                "eager": lambda x=x, k=k: torch.topk(x, k),
            },
            device,
            10,
        )
        out.append(
            dict(n=n, k=k, rows=256, buckets=b, per_bucket=kp, recall=float(hit.float().mean()),
                 approx_ms=t["approx"], eager_ms=t["eager"])
        )  # fmt: skip
        print(out[-1], flush=True)
    return out


def _geomean(v: list[float]) -> float | None:
    return math.exp(sum(map(math.log, v)) / len(v)) if v else None


def summary(rows: list[dict]) -> dict:
    speed = [r["eager_ms"] / r["ours_ms"] for r in rows]
    won = [s for s in speed if s > 1]
    return {
        "cases": len(rows),
        "identical_values": all(r["identical"] for r in rows),
        "geomean_vs_torch_topk": _geomean(speed),
        "cases_won": len(won),
        "geomean_where_won": _geomean(won),
        "geomean_topk_vs_sort_slice": _geomean([r["sort_slice_ms"] / r["eager_ms"] for r in rows]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a small CPU grid")
    ap.add_argument("--update-crossover", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    torch.manual_seed(0)
    rows = grid(device, a.smoke)
    card = "cpu" if device == "cpu" else torch.cuda.get_device_name().split()[-1].lower()
    dev_class = crossover.device_class(torch.device(device))
    s = summary(rows)
    print(s)
    write_results(
        a.out, f"topk_{card}.json", device, rows, device_class=dev_class, summary=s,
        approx=approx_rows(device),
    )  # fmt: skip
    if a.update_crossover and device == "cuda":
        crossover.update({"device_class": dev_class, "rows": rows}, f"measured topk_{card}.json")


if __name__ == "__main__":
    main()
