"""opswap::gemm (kernels/gemm.py) against cuBLAS and torch.compile on a GPU: TFLOP/s and
the share of the measured bf16 ceiling for square, LLM and odd shapes; the fused epilogue
against cuBLAS plus separate ops; FP8 against torch._scaled_mm; TF32 against float32.

    PYTHONPATH=src python3 benchmarks/bench_gemm.py --out DIR [--update-crossover]
    PYTHONPATH=src python3 benchmarks/bench_gemm.py --smoke --out /tmp/x   (CPU, tiny)

Sections (all rows: A [M, K] row-major, B a Linear weight [N, K], C [M, N]):

- square: bf16 M = N = K in 1024, 2048, 4096, 8192;
- llm: bf16 Llama-8B shapes, M in 1, 4, 16 (decode) and 2048, 8192 (prefill), with
  (N, K) = (4096, 4096) q/o, (14336, 4096) gate/up, (4096, 14336) down, (128256, 4096)
  the LM head;
- odd: bf16 1000^3, 4097^3, and a few non-multiples of 16;
- epilogue: bias + activation (+ residual) in ours against F.linear then the ops;
- fp8: e4m3 with per-tensor scales, ours against torch._scaled_mm (Hopper only);
- tf32: float32 4096^3, ours in TF32 and exact against cuBLAS float32 and cuBLAS TF32.

Peers: cuBLAS (`F.linear`, i.e. torch.mm with the weight transposed), torch.compile of the
same function (default), and torch.compile(mode="max-autotune-no-cudagraphs") on a few
shapes only (its template search takes tens of seconds a shape). Timed with
triton.testing.do_bench (median; ours called once first, so autotuning is not timed).
The bf16 ceiling is the best cuBLAS TFLOP/s of the run (the square sweep includes
8192^3). Each row checks ours against cuBLAS (relative L2) before timing.
`--update-crossover` writes the llm rows (ours against cuBLAS, and against compile where
timed) into kernels/crossover.json under "gemm", which matmul.gemm reads without a timer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import write_results  # noqa: E402

from opswap.kernels import gemm as kg  # noqa: E402

BF16 = torch.bfloat16
SQUARE = (1024, 2048, 4096, 8192)
LLM_M = (1, 4, 16, 2048, 8192)
LLM_NK = ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
ODD = ((1000, 1000, 1000), (4097, 4097, 4097), (1, 4097, 4097), (333, 1000, 4100))
#: the shapes torch.compile's max-autotune searches (tens of seconds each)
AUTOTUNED = ((4096, 4096, 4096), (16, 4096, 4096), (2048, 14336, 4096))
EPILOGUE = ((4096, 4096, 4096, "gelu_tanh", True), (2048, 14336, 4096, "silu", False))


def time_ms(fn: Callable[[], Any], device: str) -> float:
    fn()  # the first call autotunes or compiles
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return kg.gemm(x, w, None, None, "none", True, "ieee")


class Peers:
    """torch.compile of the plain product, default and max-autotune (built once)."""

    def __init__(self, device: str):
        real = device == "cuda"
        # one static compile per shape: past dynamo's recompile limit (8) a compiled
        # function silently runs eager, and the "compile" column would be cuBLAS's
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        self.compiled = torch.compile(_mm, dynamic=False) if real else _mm
        mode = "max-autotune-no-cudagraphs"
        self.autotuned = torch.compile(_mm, dynamic=False, mode=mode) if real else _mm


def gemm_row(
    section: str, m: int, n: int, k: int, device: str, peers: Peers, autotune: bool
) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=BF16)
    w = torch.randn(n, k, device=device, dtype=BF16) * k**-0.5
    out: dict[str, Any] = {"section": section, "M": m, "N": n, "K": k, "dtype": "bfloat16"}
    with torch.inference_mode():
        out["rel_l2_vs_cublas"] = rel(_ours(x, w), _mm(x, w))
        fns = {"ours": _ours, "cublas": _mm, "compile": peers.compiled}
        if autotune:
            fns["max_autotune"] = peers.autotuned
        for name, fn in fns.items():
            try:
                ms = time_ms(lambda fn=fn: fn(x, w), device)
                out[f"{name}_ms"] = ms
                out[f"{name}_tflops"] = 2 * m * n * k / (ms * 1e-3) / 1e12
            except Exception as e:  # a failing variant is a row's note, not the run's end
                out[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "ours_ms" in out and "cublas_ms" in out:
        out["ours_vs_cublas"] = out["cublas_ms"] / out["ours_ms"]
    return out


def epilogue_row(m: int, n: int, k: int, act: str, residual: bool, device: str) -> dict[str, Any]:
    torch.manual_seed(1)
    x = torch.randn(m, k, device=device, dtype=BF16)
    w = torch.randn(n, k, device=device, dtype=BF16) * k**-0.5
    b = torch.randn(n, device=device, dtype=BF16)
    r = torch.randn(m, n, device=device, dtype=BF16) if residual else None

    def unfused() -> torch.Tensor:
        y = kg.activate(F.linear(x, w, b), act)
        return y + r if r is not None else y

    def fused() -> torch.Tensor:
        return kg.gemm(x, w, b, r, act, True, "ieee")

    out: dict[str, Any] = {"section": "epilogue", "M": m, "N": n, "K": k, "act": act}
    out["residual"] = residual
    with torch.inference_mode():
        out["rel_l2_vs_cublas"] = rel(fused(), unfused())
        for name, fn in (("ours_fused", fused), ("cublas_unfused", unfused)):
            ms = time_ms(fn, device)
            out[f"{name}_ms"] = ms
            out[f"{name}_tflops"] = 2 * m * n * k / (ms * 1e-3) / 1e12
    out["speedup"] = out["cublas_unfused_ms"] / out["ours_fused_ms"]
    return out


def fp8_row(m: int, n: int, k: int) -> dict[str, Any]:
    torch.manual_seed(2)
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") * k**-0.5
    sa = (x.abs().max() / 448).float()
    sb = (w.abs().max() / 448).float()
    xq, wq = (x / sa).to(kg.FP8), (w / sb).to(kg.FP8)
    out: dict[str, Any] = {"section": "fp8", "M": m, "N": n, "K": k}

    def ours() -> torch.Tensor:
        return kg.gemm(xq, wq, None, None, "none", True, "fp8", sa, sb)

    def scaled() -> torch.Tensor:
        return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=BF16)

    with torch.inference_mode():
        out["rel_l2_vs_scaled_mm"] = rel(ours(), scaled())
        for name, fn in (("ours", ours), ("scaled_mm", scaled)):
            ms = time_ms(fn, "cuda")
            out[f"{name}_ms"] = ms
            out[f"{name}_tflops"] = 2 * m * n * k / (ms * 1e-3) / 1e12
    return out


def tf32_row(n: int) -> dict[str, Any]:
    torch.manual_seed(3)
    x, w = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda") * n**-0.5
    out: dict[str, Any] = {"section": "tf32", "M": n, "N": n, "K": n, "dtype": "float32"}
    truth = F.linear(x.double(), w.double())

    def cublas_tf32() -> torch.Tensor:
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return F.linear(x, w)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old

    fns = {
        "ours_tf32": lambda: kg.gemm(x, w, None, None, "none", True, "tf32"),
        "ours_ieee": lambda: kg.gemm(x, w, None, None, "none", True, "ieee"),
        "cublas_fp32": lambda: F.linear(x, w),
        "cublas_tf32": cublas_tf32,
    }
    with torch.inference_mode():
        for name, fn in fns.items():
            out[f"{name}_rel_l2"] = rel(fn(), truth)
            ms = time_ms(fn, "cuda")
            out[f"{name}_ms"] = ms
            out[f"{name}_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    return out


def run(smoke: bool) -> dict[str, Any]:
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --smoke for the CPU check of the script")
    peers = Peers(device)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []

    def add(make: Callable[[], dict[str, Any]], what: str) -> None:
        try:
            rows.append(make())
            print(rows[-1], flush=True)
        except Exception:
            notes.append(f"{what}: {traceback.format_exc(limit=3)}")
            print(notes[-1], flush=True)

    if smoke:
        shapes = [("square", 16, 16, 16, False), ("odd", 7, 5, 33, True)]
    else:
        shapes = [("square", s, s, s, (s, s, s) in AUTOTUNED) for s in SQUARE]
        shapes += [("llm", m, n, k, (m, n, k) in AUTOTUNED) for n, k in LLM_NK for m in LLM_M]
        shapes += [("odd", m, n, k, False) for m, n, k in ODD]
    for section, m, n, k, auto in shapes:
        add(partial(gemm_row, section, m, n, k, device, peers, auto), f"{section} {m}x{n}x{k}")
    for m, n, k, act, res in EPILOGUE if not smoke else ((9, 12, 16, "gelu_tanh", True),):
        add(partial(epilogue_row, m, n, k, act, res, device), f"epilogue {m}x{n}x{k}")
    if not smoke:
        if kg.fp8_ready(torch.device("cuda")):
            for m, n, k in ((4096, 4096, 4096), (8192, 14336, 4096)):
                add(partial(fp8_row, m, n, k), f"fp8 {m}x{n}x{k}")
        else:
            notes.append("fp8: not a Hopper GPU; the FP8 rows are skipped")
        add(lambda: tf32_row(4096), "tf32 4096")
    ceiling = max(
        (r.get("cublas_tflops", 0.0) for r in rows if r.get("dtype") == "bfloat16"), default=0.0
    )
    for r in rows:
        for key in [k for k in r if k.endswith("_tflops")]:
            if ceiling and r.get("dtype", "bfloat16") == "bfloat16" and r["section"] != "fp8":
                r[key.replace("_tflops", "_pct_ceiling")] = round(100 * r[key] / ceiling, 1)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "rows": rows, "notes": notes, "bf16_ceiling_tflops": ceiling}


def crossover_rows(res: dict[str, Any]) -> dict[str, Any]:
    """The llm rows as kernels/crossover.py's benchmark result."""
    from opswap.kernels import crossover

    out = []
    for r in res["rows"]:
        if r["section"] != "llm" or "ours_ms" not in r or "cublas_ms" not in r:
            continue
        out.append(
            {
                "kernel": "gemm",
                "dtype": "bfloat16",
                "shape": kg.shape_class(r["M"], r["N"], r["K"]),
                "pass": "forward",
                "ours_ms": r["ours_ms"],
                "eager_ms": r["cublas_ms"],
                "compile_ms": r.get("compile_ms"),
            }
        )
    return {"device_class": crossover.device_class(torch.device("cuda")), "rows": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--update-crossover", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    res = run(args.smoke)
    import triton

    card = "smoke" if args.smoke else ("h200" if "H200" in res["device"] else "h100")
    path = write_results(
        args.out,
        f"gemm_{card}.json",
        res["device"],
        res["rows"],
        triton=triton.__version__,
        cuda=torch.version.cuda,
        bf16_ceiling_tflops=res["bf16_ceiling_tflops"],
        notes=res["notes"],
        seconds=round(time.time() - t0, 1),
    )
    if args.update_crossover and not args.smoke:
        from opswap.kernels import crossover

        crossover.update(crossover_rows(res), f"measured {path.name} {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
