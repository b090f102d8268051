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

Ours is timed as the op chooses (`ours`: the launch table's choice or the default;
`ours_variant` says which ran) and as each candidate variant forced (`variants`:
{name: ms}): "tiled" (autotuned) everywhere, the persistent kernel at three
configurations on rows of more than 64 (on Hopper with the TMA API), split-K at three on
rows of up to 64 with K >= 1024 (kernels/gemm.py `candidates`).
The bf16 ceiling is the best cuBLAS TFLOP/s of the run (the square sweep includes
8192^3). Each row checks ours against cuBLAS (relative L2) before timing.
`--update-crossover` writes, per shape class of the square and llm rows, the candidate
with the lowest summed time over cuBLAS's into kernels/gemm_launch.json (the launch the op
then runs there), and the llm rows, timed at that launch, against cuBLAS (and compile
where timed) into kernels/crossover.json under "gemm", which matmul.gemm reads without a
timer.
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


def candidates(m: int, k: int, device: str) -> dict[str, kg.Launch]:
    """The forced launches a row times beside the op's own choice: "tiled" (autotuned);
    on more than 64 rows and Hopper with TMA, the persistent kernel at 128 x 256 x 64 (3
    stages, 8 warps, the tile loop flattened into the K loop and not) and 128 x 128 x 64 (4
    stages, 8 warps); on up to 64 rows with K >= 1024, split-K with 64- and 128-column
    tiles (K steps of 128) and 64 columns with K steps of 256, the split from the shape."""
    out = {"tiled": kg.Launch()}
    hopper = device == "cuda" and kg.tma_ready(torch.device("cuda"))
    if m > 64 and (hopper or device != "cuda"):
        for bn, stages, flat in ((256, 3, True), (256, 3, False), (128, 4, True)):
            lau = kg.Launch("persistent", 128, bn, 64, 8, stages, 8, flatten=flat)
            out[f"persistent_128x{bn}x64_s{stages}" + ("" if flat else "_nested")] = lau
    if m <= 64 and k >= 1024:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        for bn, bk, stages in ((64, 128, 4), (128, 128, 4), (64, 256, 3)):
            out[f"splitk_{bm}x{bn}x{bk}_s{stages}"] = kg.Launch("splitk", bm, bn, bk, 1, stages, 4)
    return out


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
        kg.LAST_RUN.clear()
        _ours(x, w)
        out["ours_variant"] = dict(kg.LAST_RUN)
        variants: dict[str, float] = {}
        launches: dict[str, dict[str, Any]] = {}
        for name, launch in candidates(m, k, device).items():
            if launch == kg.Launch() and out["ours_variant"].get("variant") == "tiled":
                if "ours_ms" in out:  # the op chose the autotuned tiled kernel: timed above
                    variants[name] = out["ours_ms"]
                    launches[name] = {**launch.to_json(), "ran": out["ours_variant"]}
                    continue
            try:
                with kg.forced_launch(launch):
                    err = rel(_ours(x, w), _mm(x, w))
                    if err > 2e-2:  # a wrong result is not timed
                        raise RuntimeError(f"relative L2 {err:.2e} against cuBLAS")
                    variants[name] = time_ms(lambda: _ours(x, w), device)
                    launches[name] = {**launch.to_json(), "ran": dict(kg.LAST_RUN)}
            except Exception as e:
                out[f"variant_error:{name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out["variants"], out["launches"] = variants, launches
    if "ours_ms" in out and "cublas_ms" in out:
        out["ours_vs_cublas"] = out["cublas_ms"] / out["ours_ms"]
    if variants and "cublas_ms" in out:
        best = min(variants, key=variants.__getitem__)
        out["best_variant"], out["best_ms"] = best, variants[best]
        out["best_vs_cublas"] = out["cublas_ms"] / variants[best]
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
        shapes += [("llm", 1, 32, 1024, False), ("llm", 4, 48, 1024, False)]
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


def launch_rows(res: dict[str, Any], device_class: str) -> list[dict[str, Any]]:
    """Per shape class of the square and llm rows, the candidate with the lowest sum of
    its time over cuBLAS's across the class's rows (among those timed on every row of the
    class), as kernels/gemm.py's launch table rows."""
    by_class: dict[str, list[dict[str, Any]]] = {}
    for r in res["rows"]:
        if r["section"] in ("square", "llm") and r.get("variants") and r.get("cublas_ms"):
            by_class.setdefault(kg.shape_class(r["M"], r["N"], r["K"]), []).append(r)
    out = []
    for shape, rows in by_class.items():
        common = set.intersection(*(set(r["variants"]) for r in rows))
        if not common:
            continue
        best = min(
            sorted(common), key=lambda v: sum(r["variants"][v] / r["cublas_ms"] for r in rows)
        )
        launch = {
            f: v
            for f, v in rows[0]["launches"][best].items()
            if f in kg.Launch.__dataclass_fields__
        }
        out.append(
            {
                "device": device_class,
                "dtype": "bfloat16",
                "precision": "ieee",
                "shape": shape,
                "launch": launch,
                "ms": [round(r["variants"][best], 5) for r in rows],
                "cublas_ms": [round(r["cublas_ms"], 5) for r in rows],
            }
        )
    return out


def crossover_rows(res: dict[str, Any], chosen: dict[str, str] | None = None) -> dict[str, Any]:
    """The llm rows as kernels/crossover.py's benchmark result; with `chosen` (shape class
    -> candidate name, the launch table's new choice) timed at that candidate."""
    from opswap.kernels import crossover

    out = []
    for r in res["rows"]:
        if r["section"] != "llm" or "ours_ms" not in r or "cublas_ms" not in r:
            continue
        shape = kg.shape_class(r["M"], r["N"], r["K"])
        pick = (chosen or {}).get(shape)
        ours = r["variants"][pick] if pick and pick in r.get("variants", {}) else r["ours_ms"]
        out.append(
            {
                "kernel": "gemm",
                "dtype": "bfloat16",
                "shape": shape,
                "pass": "forward",
                "ours_ms": ours,
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
        # what --update-crossover would write into the launch table from these rows
        launch_table_rows=launch_rows(res, "smoke" if args.smoke else "this run"),
    )
    if args.update_crossover and not args.smoke:
        from opswap.kernels import crossover

        source = f"measured {path.name} {time.strftime('%Y-%m-%d')}"
        table = launch_rows(res, crossover.device_class(torch.device("cuda")))
        kg.update_launch_table(table, source)
        chosen = {}
        for t in table:  # the candidate's name back from its launch
            for r in res["rows"]:
                for name, lau in r.get("launches", {}).items():
                    if kg.shape_class(r["M"], r["N"], r["K"]) == t["shape"] and all(
                        lau.get(f) == v for f, v in t["launch"].items()
                    ):
                        chosen[t["shape"]] = name
        crossover.update(crossover_rows(res, chosen), source)
        # a copy beside the results, so that the table comes back with them from a GPU host
        (args.out / kg.LAUNCH_TABLE.name).write_text(kg.LAUNCH_TABLE.read_text())
        print(f"launch table: {len(table)} shape classes; crossover: gemm rows rewritten")


if __name__ == "__main__":
    main()
