"""Linear + ReLU and Linear + tanh-GELU with the activation in cuBLASLt's epilogue
(`aten._addmm_activation`, what activation.linear_epilogue writes) against eager (addmm,
then the activation as its own kernel) and torch.compile of the eager module, on a GPU.

    PYTHONPATH=src python3 benchmarks/bench_epilogue.py --out DIR
    PYTHONPATH=src python3 benchmarks/bench_epilogue.py --smoke     (CPU, tiny shapes)

Shapes: M = batch * seq in {512, 4096, 16384}; (K, N) in {(768, 3072) BERT-base's and
GPT-2's MLP up-projection, (1024, 4096) BERT-large's, (4096, 11008) Llama-7B's}; bfloat16
and float16. Timed with triton.testing.do_bench (median, L2 flushed between repetitions).
TFLOP/s counts the GEMM's 2 M K N only, so the three variants compare on one scale; the
bytes the epilogue saves are the activation's read and write of the [M, N] output,
2 M N elements, next to which the GEMM reads M K + K N and writes M N.

Each row checks the fused output against eager's (the same math: the epilogue rounds
once where eager rounds twice) before timing, and records the max abs difference.
Writes DIR/epilogue_h200.json (epilogue_smoke.json with --smoke) with the device,
versions and date. `--smoke` runs every path at tiny shapes on the CPU (eager stands in
for torch.compile, the CPU op computes erf-GELU for use_gelu, so the GELU check is
against the erf form there), to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import write_results  # noqa: E402

MS = (512, 4096, 16384)
KN = ((768, 3072), (1024, 4096), (4096, 11008))
DTYPES = (torch.bfloat16, torch.float16)
ACTIVATIONS = ("relu", "gelu_tanh")


def eager(act: str):
    """The module as a user writes it: addmm (nn.Linear on 2-D rows) then the activation."""
    if act == "relu":
        return lambda x, w, b: torch.relu(F.linear(x, w, b))
    return lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")


def fused(act: str):
    gelu = act == "gelu_tanh"
    return lambda x, w, b: torch.ops.aten._addmm_activation(b, x, w.t(), use_gelu=gelu)


def time_ms(fn, device: str, smoke: bool) -> float:
    if smoke or device != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def row(m, k, n, dtype, act, device, smoke, compiled) -> dict:
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
    b = torch.randn(n, device=device, dtype=dtype)
    fns = {"eager": eager(act), "addmm_activation": fused(act), "compile": compiled[act]}
    out: dict = {"M": m, "K": k, "N": n, "dtype": str(dtype).removeprefix("torch."), "act": act}
    with torch.inference_mode():
        want = fns["eager"](x, w, b).float()
        if device == "cpu" and act == "gelu_tanh":  # the CPU op computes the erf form
            want = F.gelu(F.linear(x, w, b).float())
        got = fns["addmm_activation"](x, w, b).float()
        out["max_abs_vs_eager"] = float((got - want).abs().max())
        for name, fn in fns.items():
            try:
                ms = time_ms(lambda fn=fn: fn(x, w, b), device, smoke)
                out[f"{name}_ms"] = ms
                out[f"{name}_tflops"] = 2 * m * k * n / (ms * 1e-3) / 1e12
            except Exception as e:  # a failing variant is a row's note, not the run's end
                out[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "eager_ms" in out and "addmm_activation_ms" in out:
        out["speedup_vs_eager"] = out["eager_ms"] / out["addmm_activation_ms"]
    if "compile_ms" in out and "addmm_activation_ms" in out:
        out["speedup_vs_compile"] = out["compile_ms"] / out["addmm_activation_ms"]
    return out


def run(smoke: bool = False) -> dict:
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --smoke for the CPU check")
    ms, kn = ((5,), ((12, 24),)) if smoke else (MS, KN)
    dtypes = (torch.float32,) if smoke else DTYPES
    compiled = {a: (eager(a) if smoke else torch.compile(eager(a))) for a in ACTIVATIONS}
    notes = ["smoke: eager stands in for torch.compile, float32 on the CPU"] if smoke else []
    rows = []
    for dtype in dtypes:
        for k, n in kn:
            for m in ms:
                for act in ACTIVATIONS:
                    try:
                        rows.append(row(m, k, n, dtype, act, device, smoke, compiled))
                    except Exception:
                        notes.append(f"M={m} K={k} N={n} {dtype} {act}: {traceback.format_exc()}")
                    print(rows[-1] if rows else notes[-1], flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "notes": notes, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args()
    res = run(args.smoke)
    import triton

    write_results(
        args.out,
        f"epilogue_{'smoke' if args.smoke else 'h200'}.json",
        res["device"],
        res["rows"],
        triton=triton.__version__,
        cuda=torch.version.cuda,
        notes=res["notes"],
    )


if __name__ == "__main__":
    main()
