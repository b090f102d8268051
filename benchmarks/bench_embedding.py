"""Table-batched embedding bags (chapter 18): 10 and 100 tables looked up from one batch
(batch 2048, bags of 20), forward, as the per-table loop of F.embedding_bag, as
torch.compile of that loop, and as one opswap::batched_embedding_bag over the tables
concatenated (float32, and the int8 table with its scale and bias); the row bytes read per
second against a device copy's bandwidth. On the CPU a smaller version (batch 256, 1e4
rows a table), where the op is one F.embedding_bag over all bags; torch.compile of the
loop is the peer timed beside it on both devices.

    python benchmarks/bench_embedding.py            # CUDA: 1e6 rows x 64 (10 tables), 1e5 x 128 (100)
    python benchmarks/bench_embedding.py --smoke    # CPU: writes embedding_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from _results import write_results  # noqa: E402

from opswap.kernels import embedding_bag as E  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _time(fns: dict, device: str, reps: int) -> dict[str, float]:
    for f in fns.values():
        f()
        f()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            if device == "cuda":
                torch.cuda.synchronize()
            out[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def copy_gbs(device: str, nbytes: int = 1 << 28) -> float:
    """A device copy's bandwidth (bytes read + written per second), GB/s."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _time({"copy": lambda: dst.copy_(src)}, device, 10)["copy"]
    return 2 * nbytes / (t * 1e-3) / 1e9


def case(tables: int, rows: int, dim: int, batch: int, bag: int, device: str, reps: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(tables)
    ws = [torch.randn(rows, dim, generator=g).to(device) for _ in range(tables)]
    idx = [torch.randint(0, rows, (batch, bag), generator=g).to(device) for _ in range(tables)]
    cat = torch.cat(ws)
    offsets = torch.arange(tables, device=device) * rows
    q, scale, bias = E.quantize_rows(cat)

    def loop(*ii: torch.Tensor) -> list[torch.Tensor]:
        return [F.embedding_bag(i, w, mode="sum") for i, w in zip(ii, ws, strict=True)]

    def batched(*ii: torch.Tensor) -> torch.Tensor:
        return E.batched_embedding_bag(
            cat, offsets, torch.stack(ii, 1), None, False, None, None, None
        )

    def batched_int8(*ii: torch.Tensor) -> torch.Tensor:
        return E.batched_embedding_bag(
            q, offsets, torch.stack(ii, 1), None, False, scale, bias, None
        )

    fns = {
        "loop": lambda: loop(*idx),
        "opswap": lambda: batched(*idx),
        "opswap_int8": lambda: batched_int8(*idx),
    }
    comp = torch.compile(loop)  # the peer on either device: Inductor's code for the loop
    fns["compile_loop"] = lambda: comp(*idx)
    err = float((torch.stack(loop(*idx), 1) - batched(*idx)).abs().max())
    err_compile = float((torch.stack(comp(*idx), 1) - batched(*idx)).abs().max())
    t = _time(fns, device, reps)
    read = batch * tables * bag * dim * 4
    row = {
        "tables": tables, "rows": rows, "dim": dim, "batch": batch, "bag": bag,
        "max_abs_vs_loop": err, **{f"{k}_ms": v for k, v in t.items()},
        "max_abs_vs_compile_loop": err_compile,
        "speedup_vs_loop": t["loop"] / t["opswap"],
        "speedup_vs_compile_loop": t["compile_loop"] / t["opswap"],
        "int8_speedup_vs_loop": t["loop"] / t["opswap_int8"],
        "rows_read_gbs": read / (t["opswap"] * 1e-3) / 1e9,
        "table_bytes": cat.numel() * 4,
        "int8_table_bytes": q.numel() + 8 * q.shape[0],
    }  # fmt: skip
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="the small CPU version")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    torch.manual_seed(0)
    if device == "cuda":
        shapes = [(10, 1_000_000, 64, 2048, 20), (100, 100_000, 128, 2048, 20)]
        reps = 30
    else:
        shapes = [(10, 10_000, 64, 256, 20), (100, 10_000, 64, 256, 20)]
        reps = 10
    copy = copy_gbs(device)
    rows = [case(*s, device, reps) for s in shapes]
    for r in rows:
        r["copy_gbs"] = copy
        r["share_of_copy"] = r["rows_read_gbs"] / copy
    card = "cpu" if device == "cpu" else torch.cuda.get_device_name().split()[-1].lower()
    write_results(a.out, f"embedding_{card}.json", device, rows)


if __name__ == "__main__":
    main()
