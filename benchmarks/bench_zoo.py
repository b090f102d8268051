"""Forward and capture time of every zoo model (and the hf: types when transformers
imports): the zoo promises models that run in well under a second on a CPU.

    python benchmarks/bench_zoo.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from opswap.api import capture
from opswap.bench.timing import benchmark
from opswap.models import list_hf_types, list_zoo, load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    specs = [f"zoo:{z.name}" for z in list_zoo()]
    if not args.no_hf:
        try:
            import transformers  # noqa: F401

            specs += [f"hf:{t}" for t in list_hf_types()]
        except ImportError:
            pass
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        m = load(spec)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        c = capture(m.module, m.example_inputs)
        capture_s = time.perf_counter() - t0
        with torch.inference_mode():
            r = benchmark({"forward": lambda m=m: m.module(*m.example_inputs)}, min_time_s=0.3)
        row = {
            "model": spec,
            "load_s": round(load_s, 3),
            "capture_s": round(capture_s, 3),
            "capture_method": c.method,
            "forward_ms": r.stats["forward"].median_ms,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    from _results import write_results

    write_results(
        args.out,
        "bench_zoo.json",
        f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        rows,
    )


if __name__ == "__main__":
    main()
