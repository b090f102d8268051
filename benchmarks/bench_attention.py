"""Attention on the GPU, forward and forward+backward: opswap's Triton FlashAttention
against SDPA's backends and hand-written attention, in one run.

    PYTHONPATH=src python3 benchmarks/bench_attention.py --out DIR [--quick] [--update-crossover]
    PYTHONPATH=src python benchmarks/bench_attention.py --smoke     # CPU, interpreter, tiny

bf16, batch 8, 16 heads, head dims 64 and 128, sequence 1024 to 8192, causal and not. Per
point: ours (`opswap::flash_attention`, autotuned; pointer loads, and the tensor-descriptor
loads as `ours_tma` where the GPU has them), SDPA forced to each backend
(torch.nn.attention.sdpa_kernel: FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION; a
backend that refuses the point is recorded as such) and the hand-written
matmul-softmax-matmul (up to 4096: past it the scores alone are 8 GiB a pass), each timed
by triton.testing.do_bench (median ms). TFLOP/s count 4·B·H·S_q·S_k·D for the forward,
2.5x that for forward+backward, halved for causal. Before timing, ours is checked against
SDPA at the point (rel. L2 of the output and of dq, dk, dv). Writes
DIR/attention_h200.json with device, versions, date; `--update-crossover` rewrites
src/opswap/kernels/crossover.json's flash_attention entries from it (ours against SDPA's
fastest backend at each point).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PASSES = ("forward", "forward+backward")
#: the hand-written attention is timed up to this length (memory: B·H·S² scores)
EAGER_MAX_SEQ = 4096


def _eager(q, k, v, causal):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(
            ~torch.ones(s.shape[-2], n, dtype=torch.bool, device=s.device).tril(), float("-inf")
        )
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def _rel(a, b) -> float:
    return float(((a.float() - b.float()).norm() / b.float().norm()).item())


def _variants(causal: bool, dev: str) -> dict:
    """name -> fn(q, k, v) for every contender at one point."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from opswap.kernels import flash_attention as FA

    def ours(q, k, v):
        return FA.flash_attention(q, k, v, causal=causal)

    def ours_tma(q, k, v):
        FA.set_tma(True)
        try:
            return FA.flash_attention(q, k, v, causal=causal)
        finally:
            FA.set_tma(False)

    fns = {"ours": ours}
    if dev == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
        fns["ours_tma"] = ours_tma
    for name, be in (
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def f(q, k, v, be=be):
            with sdpa_kernel([be]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        fns[name] = f
    fns["eager"] = lambda q, k, v: _eager(q, k, v, causal)
    return fns


def _check(fn, q, k, v, do, causal) -> dict:
    """Ours against SDPA (default backend) at the point: rel. L2 of o, dq, dk, dv."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    wg = torch.autograd.grad(want, leaves, do)
    got = fn(*leaves)
    gg = torch.autograd.grad(got, leaves, do)
    out = {"o": _rel(got, want)}
    out.update({n: _rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), gg, wg, strict=True)})
    return out


def run(smoke: bool = False, quick: bool = False) -> dict:
    import triton
    import triton.testing

    from opswap.kernels import crossover

    dev = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    b, h = (1, 2) if smoke else (8, 16)
    seqs = [32] if smoke else ([1024, 4096] if quick else [1024, 2048, 4096, 8192])
    dims = [64] if smoke else [64, 128]
    rows, cx_rows = [], []
    for d in dims:
        for causal in (False, True):
            fns = _variants(causal, dev)
            for s in seqs:
                g = torch.Generator(device=dev).manual_seed(s + d)
                q, k, v, do = (
                    torch.randn(b, h, s, d, device=dev, dtype=dtype, generator=g) for _ in range(4)
                )
                fwd_flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
                row: dict = {"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": causal}
                for name in ("ours", "ours_tma"):
                    if name in fns:
                        try:
                            row[f"{name}_rel_l2_vs_sdpa"] = _check(fns[name], q, k, v, do, causal)
                        except Exception as e:  # a path that does not build here
                            row[f"{name}_error"] = str(e).splitlines()[0][:160]
                bad = [
                    n
                    for n in ("ours", "ours_tma")
                    if max(row.get(f"{n}_rel_l2_vs_sdpa", {"_": 0.0}).values()) > 2e-2
                ]
                for name, fn in fns.items():
                    if name in bad or f"{name}_error" in row:
                        continue
                    if name == "eager" and s > EAGER_MAX_SEQ:
                        row["eager_error"] = f"not timed past {EAGER_MAX_SEQ} (memory)"
                        continue
                    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

                    def fwd(fn=fn, leaves=leaves):
                        with torch.no_grad():
                            return fn(*leaves)

                    def fwd_bwd(fn=fn, leaves=leaves, do=do):
                        fn(*leaves).backward(do)

                    for pass_, call, mult in (
                        ("forward", fwd, 1.0),
                        ("forward+backward", fwd_bwd, 2.5),
                    ):
                        tag = "" if pass_ == "forward" else "_fb"
                        try:
                            if smoke:
                                call()
                                row[f"{name}{tag}_ms"] = None
                                continue
                            ms = triton.testing.do_bench(
                                call, warmup=10, rep=40, grad_to_none=leaves
                            )
                            row[f"{name}{tag}_ms"] = ms
                            row[f"{name}{tag}_tflops"] = mult * fwd_flops / (ms * 1e-3) / 1e12
                        except Exception as e:  # a backend that refuses the point
                            row[f"{name}{tag}_error"] = str(e).splitlines()[0][:160]
                            if dev == "cuda":
                                torch.cuda.synchronize()
                for pass_, tag in zip(PASSES, ("", "_fb"), strict=True):
                    sd = [
                        row.get(f"{n}{tag}_ms")
                        for n in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
                    ]
                    sd = [x for x in sd if x]
                    if row.get(f"ours{tag}_ms") and sd:
                        cx_rows.append({
                            "kernel": "flash_attention", "dtype": str(dtype).removeprefix("torch."),
                            "shape": crossover.attention_shape(s, s, d, causal), "pass": pass_,
                            "hidden": d, "rows": s, "ours_ms": row[f"ours{tag}_ms"],
                            "eager_ms": min(sd), "compile_ms": None,
                        })  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
        "device_class": crossover.device_class(torch.device(dev)) if dev == "cuda" else "",
        "dtype": str(dtype),
        "flops": "forward 4*B*H*S_q*S_k*D, forward+backward 2.5x, halved for causal",
        "rows": rows,
        "crossover_rows": cx_rows,
    }


def table(res: dict) -> str:
    names = ["ours", "ours_tma", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "eager"]
    out = [
        "| pass | D | causal | seq | " + " | ".join(names) + " | ours / best SDPA |",
        "|---" * 11 + "|",
    ]
    for pass_, tag in zip(PASSES, ("", "_fb"), strict=True):
        for r in res["rows"]:
            vals = [r.get(f"{n}{tag}_tflops") for n in names]
            sd = [x for x in vals[2:5] if x]
            ratio = f"{vals[0] / max(sd):.2f}" if vals[0] and sd else "-"
            cells = [f"{x:.0f}" if x else "-" for x in vals]
            out.append(
                f"| {pass_} | {r['head_dim']} | {r['causal']} | {r['seq']} | "
                + " | ".join(cells)
                + f" | {ratio} |"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreter")
    ap.add_argument("--quick", action="store_true", help="seq 1024 and 4096 only")
    ap.add_argument("--update-crossover", action="store_true", help="rewrite crossover.json")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    res = run(args.smoke, args.quick)
    print(table(res))
    from _results import write_kernel_run

    rows = {"device_class": res.get("device_class"), "rows": res.get("crossover_rows", [])}
    write_kernel_run(res, args.out, "attention", args.smoke, args.update_crossover, rows)


if __name__ == "__main__":
    main()
