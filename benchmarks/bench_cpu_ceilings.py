"""Measure this machine's roofline ceilings and write them to benchmarks/results/.

The `cpu` target (opswap.targets.cpu) measures one float32 matmul size and one
copy size in about a second. This script takes longer and looks wider: matmul
FLOP/s over several sizes and dtypes, and bandwidth over several buffer sizes
(small buffers show cache bandwidth, large ones main memory), next to the
figures the `cpu` target uses.

    python benchmarks/bench_cpu_ceilings.py [--out benchmarks/results/cpu_ceilings.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import torch

from opswap.targets import get_target
from opswap.targets.cpu import cpu_model


def best_time(fn, reps: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(n: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    c = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b, out=c), reps=5)


def copy_bandwidth(nbytes: int) -> float:
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_time(lambda: dst.copy_(src))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/cpu_ceilings.json")
    args = p.parse_args()

    target = get_target("cpu", refresh=True)
    matmul = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (256, 512, 1024, 2048):
            f = matmul_flops(n, dtype)
            matmul.append({"dtype": str(dtype).removeprefix("torch."), "n": n, "flops_per_s": f})
            print(f"matmul {dtype} n={n}: {f / 1e9:.1f} GFLOP/s")
    bandwidth = []
    for mib in (1, 8, 64, 256):
        bw = copy_bandwidth(mib * 2**20)
        bandwidth.append({"buffer_mib": mib, "bytes_per_s": bw})
        print(f"copy {mib} MiB: {bw / 1e9:.1f} GB/s")

    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "device": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "cpu_target": {
            "peak_flops": dict(target.peak_flops),
            "mem_bandwidth": target.mem_bandwidth,
            "ridge_point": target.ridge_point("float32"),
            "source": target.source,
        },
        "matmul": matmul,
        "bandwidth": bandwidth,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"cpu target: {target.peak() / 1e9:.1f} GFLOP/s, {target.mem_bandwidth / 1e9:.1f} GB/s, "
        f"ridge {target.ridge_point():.1f} FLOP/byte -> {out}"
    )


if __name__ == "__main__":
    main()
