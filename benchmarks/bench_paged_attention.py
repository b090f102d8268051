"""Paged attention on the GPU: opswap's paged decode kernel against SDPA (flash backend) on a
contiguous cache and against opswap's static-cache split-K kernel (`decode_attention`),
and the chunked-prefill kernel against SDPA causal, in one run, next to the card's copy
bandwidth.

    PYTHONPATH=src python benchmarks/bench_paged_attention.py --out DIR   # DIR/paged_attention_<card>.json
    PYTHONPATH=src python benchmarks/bench_paged_attention.py --smoke     # CPU: the references, seconds

Decode: batch 1/8/32/128 x context 128..8192, bf16, block size 16, the blocks of each
sequence shuffled through the pool; heads of Llama-1.1B (32 query, 4 KV, head dim 64) and
Llama-8B (32 / 8, 128). Every variant's step is captured in a CUDA graph (10 calls) and
replayed, so the times are GPU time, not Python's launch cost (the serving engine replays
graphs too). Achieved bandwidth = bytes of K and V read / time, as a share of a large
device-to-device copy's bandwidth measured in the same run. FlashInfer and vLLM are not
installed on the benchmark machine: not measured (said in the JSON).
Prefill: one sequence's chunk of 256 or 512 tokens, fresh (context = chunk) and after a
cached prefix of 1024, against SDPA causal on the contiguous keys (the fresh case only:
SDPA's causal mask is the top-left one).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import write_results  # noqa: E402

from opswap.kernels import paged_attention as pa  # noqa: E402
from opswap.kernels.decode_attention import decode_attention  # noqa: E402

MODELS = {"llama_1b": (32, 4, 64), "llama_8b": (32, 8, 128)}
BATCHES = (1, 8, 32, 128)
CONTEXTS = (128, 512, 2048, 8192)
BLOCK = 16
CALLS = 10  # calls captured per graph


def copy_bandwidth(device: str) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write bytes over time)."""
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = graph_ms(lambda: b.copy_(a), device)
    return 2 * a.numel() / (ms * 1e-3) / 1e9


def graph_ms(fn: Callable[[], object], device: str, reps: int = 7) -> float:
    """Median ms of one call: CALLS calls captured in a CUDA graph, replayed (eager on CPU)."""
    import statistics
    import time

    fn()  # autotuning and compilation happen here, before the capture
    if device != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def paged_cache(
    batch: int, ctx: int, kv_heads: int, d: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous K, V [B, H_kv, ctx, D] and the same tokens in shuffled blocks of BLOCK."""
    per = (ctx + BLOCK - 1) // BLOCK
    k = torch.randn(batch, kv_heads, ctx, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    order = torch.randperm(batch * per, device=device)
    tables = order.view(batch, per).int()

    def pool(x: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros(batch, kv_heads, per * BLOCK, d, device=device, dtype=x.dtype)
        pad[:, :, :ctx] = x
        blocks = pad.permute(0, 2, 1, 3).reshape(batch * per, BLOCK, kv_heads, d)
        out = torch.empty_like(blocks)
        out[order] = blocks
        return out

    return k, v, pool(k), pool(v), tables


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    flash: bool = False,
) -> torch.Tensor:
    """SDPA over a contiguous GQA cache; `flash`: its flash backend only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attend = torch.nn.functional.scaled_dot_product_attention
    if not flash:
        return attend(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return attend(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def decode_rows(
    device: str, bw: float, smoke: bool, save: Callable[[list[dict]], None]
) -> list[dict]:
    rows: list[dict] = []
    models = {"tiny": (4, 2, 64)} if smoke else MODELS
    for model, (h, hk, d) in models.items():
        for batch in (1, 2) if smoke else BATCHES:
            for ctx in (33,) if smoke else CONTEXTS:
                if batch * ctx * hk * d * 2 * 2 * 2 > 12e9:  # both copies of K and V
                    continue
                k, v, kc, vc, tables = paged_cache(batch, ctx, hk, d, device)
                q = torch.randn(batch, h, d, device=device, dtype=torch.bfloat16)
                lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
                scale = d**-0.5
                ours = pa.paged_decode_attention(q, kc, vc, tables, lens, scale)
                want = pa.reference_decode(q[:2], kc, vc, tables[:2], lens[:2], scale)
                err = float((ours[:2].float() - want.float()).abs().max())
                q4 = q[:, :, None]
                fns: dict[str, Callable[[], object]] = {
                    "paged": partial(pa.paged_decode_attention, q, kc, vc, tables, lens, scale),
                    "static_split_k": partial(decode_attention, q4, k, v, lens, scale),
                    "sdpa_flash": partial(sdpa, q4, k, v, scale, False, flash=True),
                }
                kv_bytes = batch * ctx * hk * d * 2 * 2
                row: dict = {"part": "decode", "model": model, "batch": batch, "context": ctx}
                row["max_abs_err_vs_reference"] = err
                for name, fn in fns.items():
                    try:
                        ms = graph_ms(fn, device)
                    except Exception as e:  # a peer that cannot run this shape says why
                        row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                        continue
                    gbs = kv_bytes / (ms * 1e-3) / 1e9
                    row[name] = {"us": ms * 1e3, "kv_gb_s": gbs, "pct_copy_bw": 100 * gbs / bw}
                print(row, flush=True)
                rows.append(row)
                save(rows)
                del k, v, kc, vc
    return rows


def prefill_rows(device: str, smoke: bool, save: Callable[[list[dict]], None]) -> list[dict]:
    rows: list[dict] = []
    models = {"tiny": (4, 2, 64)} if smoke else MODELS
    for model, (h, hk, d) in models.items():
        for chunk in (16,) if smoke else (256, 512):
            for prefix in (0, 1024):
                ctx = prefix + chunk
                k, v, kc, vc, tables = paged_cache(1, ctx, hk, d, device)
                q = torch.randn(chunk, h, d, device=device, dtype=torch.bfloat16)
                cu = torch.tensor([0, chunk], device=device, dtype=torch.int32)
                lens = torch.tensor([ctx], device=device, dtype=torch.int32)
                scale = d**-0.5
                ours = pa.paged_prefill_attention(q, kc, vc, tables, cu, lens, scale)
                want = pa.reference_prefill(q, kc, vc, tables, cu, lens, scale)
                flops = 4 * h * d * (chunk * prefix + chunk * (chunk + 1) / 2)
                fns: dict[str, Callable[[], object]] = {
                    "paged": partial(pa.paged_prefill_attention, q, kc, vc, tables, cu, lens, scale)
                }
                if prefix == 0:
                    fns["sdpa_causal"] = partial(sdpa, q.transpose(0, 1)[None], k, v, scale, True)
                row: dict = {"part": "prefill", "model": model, "chunk": chunk, "prefix": prefix}
                row["max_abs_err_vs_reference"] = float((ours.float() - want.float()).abs().max())
                for name, fn in fns.items():
                    try:
                        ms = graph_ms(fn, device)
                    except Exception as e:
                        row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                        continue
                    row[name] = {"us": ms * 1e3, "tflop_s": flops / (ms * 1e-3) / 1e12}
                print(row, flush=True)
                rows.append(row)
                save(rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (references)")
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    smoke = device == "cpu"
    torch.manual_seed(0)
    bw = copy_bandwidth(device) if not smoke else float("nan")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    card = name.split()[-1].lower() if device == "cuda" else "cpu_smoke"
    import triton

    def save(rows: list[dict]) -> None:  # after every row: a run cut short keeps its rows
        write_results(
            args.out,
            f"paged_attention_{card}.json",
            name,
            rows,
            triton=triton.__version__,
            copy_gb_s=bw,
            block_size=BLOCK,
            timing=f"CUDA graph of {CALLS} calls, median of 7 replays"
            if not smoke
            else "CPU smoke: one eager call, the references (no kernel runs off the GPU)",
            not_measured="FlashInfer and vLLM paged attention: not installed on the machine",
        )

    done = decode_rows(device, bw, smoke, save)
    prefill_rows(device, smoke, lambda rows: save(done + rows))


if __name__ == "__main__":
    main()
