"""Attention forward on the GPU: opswap's Triton FlashAttention against SDPA's backends and
hand-written attention, in one run.

    PYTHONPATH=src python3 benchmarks/bench_attention.py --out DIR [--quick]
    PYTHONPATH=src python benchmarks/bench_attention.py --smoke     # CPU, interpreter, tiny

bf16, batch 8, 16 heads, head dims 64 and 128, sequence 512 to 8192, causal and not. Per
point: ours (`opswap::flash_attention`, autotuned), SDPA forced to each backend
(torch.nn.attention.sdpa_kernel: FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION;
a backend that refuses the point is recorded as such) and the hand-written
matmul-softmax-matmul, each timed by triton.testing.do_bench (median ms). TFLOP/s count
4·B·H·S_q·S_k·D for the two matmuls, halved for causal. Ours is checked against SDPA
(rel. L2) before it is timed. Writes DIR/attention_h200.json with device, versions, date.
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


def _eager(q, k, v, causal):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(
            ~torch.ones(s.shape[-2], n, dtype=torch.bool, device=s.device).tril(), float("-inf")
        )
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def _device_class(dev: str) -> str | None:
    if dev != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def run(smoke: bool = False, quick: bool = False) -> dict:
    import triton
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from opswap.kernels.flash_attention import flash_attention

    dev = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    b, h = (1, 2) if smoke else (8, 16)
    seqs = [32] if smoke else ([1024, 4096] if quick else [512, 1024, 2048, 4096, 8192])
    dims = [64] if smoke else [64, 128]
    backends = {
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    rows = []
    for d in dims:
        for causal in (False, True):
            for s in seqs:
                g = torch.Generator(device=dev).manual_seed(s + d)
                q, k, v = (
                    torch.randn(b, h, s, d, device=dev, dtype=dtype, generator=g) for _ in range(3)
                )
                flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
                row: dict = {"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": causal}

                def ours(q=q, k=k, v=v, causal=causal):
                    return flash_attention(q, k, v, causal=causal)

                want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                got = ours()
                row["rel_l2_vs_sdpa"] = float(
                    ((got.float() - want.float()).norm() / want.float().norm()).item()
                )
                fns = {"ours": ours, "eager": lambda q=q, k=k, v=v, c=causal: _eager(q, k, v, c)}
                for name, be in backends.items():

                    def f(q=q, k=k, v=v, causal=causal, be=be):
                        with sdpa_kernel([be]):
                            return torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, is_causal=causal
                            )

                    fns[name] = f
                for name, fn in fns.items():
                    if smoke:
                        try:
                            fn()
                            row[f"{name}_ms"] = None
                        except Exception as e:
                            row[f"{name}_error"] = str(e).splitlines()[0][:160]
                        continue
                    try:
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                        row[f"{name}_ms"] = ms
                        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
                    except Exception as e:  # a backend that refuses the point
                        row[f"{name}_error"] = str(e).splitlines()[0][:160]
                        torch.cuda.synchronize() if dev == "cuda" else None
                print(json.dumps(row), flush=True)
                rows.append(row)
    import triton as _t

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _t.__version__,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
        "device_class": _device_class(dev),
        "dtype": str(dtype),
        "pass": "forward",
        "flops": "4*B*H*S_q*S_k*D, halved for causal",
        "rows": rows,
    }


def table(res: dict) -> str:
    names = ["ours", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "eager"]
    out = ["| D | causal | seq | " + " | ".join(names) + " | ours / best SDPA |", "|---" * 9 + "|"]
    for r in res["rows"]:
        vals = [r.get(f"{n}_tflops") for n in names]
        sd = [x for x in vals[1:4] if x]
        ratio = f"{vals[0] / max(sd):.2f}" if vals[0] and sd else "-"
        cells = [f"{x:.0f}" if x else "-" for x in vals]
        out.append(
            f"| {r['head_dim']} | {r['causal']} | {r['seq']} | "
            + " | ".join(cells)
            + f" | {ratio} |"
        )
    return "\n".join(out)


def crossover_rows(res: dict) -> dict:
    """The run as kernels/crossover.py's benchmark rows: "eager" is the fastest SDPA
    backend at the point (what the rule replaces), the pass says causal or not."""
    rows = []
    for r in res["rows"]:
        sd = [r.get(f"{n}_ms") for n in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")]
        sd = [x for x in sd if x]
        if not sd or not r.get("ours_ms"):
            continue
        rows.append(
            {
                "kernel": "flash_attention",
                "dtype": res["dtype"].removeprefix("torch."),
                "hidden": r["head_dim"],
                "rows": r["seq"],
                "pass": "forward,causal" if r["causal"] else "forward",
                "ours_ms": r["ours_ms"],
                "eager_ms": min(sd),
                "compile_ms": None,
            }
        )
    return {"device_class": res.get("device_class"), "rows": rows}


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
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("attention_smoke.json" if args.smoke else "attention_h200.json")
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(table(res))
    print("wrote", path)
    if args.update_crossover and not args.smoke:
        from opswap.kernels import crossover

        new = crossover.update(crossover_rows(res), f"measured {path.name} {res['date'][:10]}")
        print(f"crossover.json: {len(new)} flash_attention entries measured")


if __name__ == "__main__":
    main()
