"""Where the host time of one eager call of an opswap row op goes (issue 37 §5).

At 4096x4096 opswap's RMSNorm and LayerNorm reached 0.50-0.65x of the best peer on an
H100 while at 16k-64k rows they run at 92-99% of copy bandwidth: the gap is the host's
time per call, not the kernel. This script peels the call apart, layer by layer, for
`opswap::rms_norm` and `opswap::layer_norm`:

- `op`: `torch.ops.opswap.X.default(...)`, what an FX graph calls (dispatcher, the
  autograd key of `register_autograd`, the Python implementation);
- `python fn`: the op's Python function called directly (no dispatcher);
- `impl`: the module's `triton_forward` (our Python: shape checks, allocation, launch);
- `launch`: the Triton kernel launch alone, through `wrap_triton` as `triton_forward` does;
- `jit`: the same launch without `wrap_triton`;
- peers: torch's own eager op (F.rms_norm / F.layer_norm) and torch.compile of it.

Each row gives the host time per call (`host_us`: calls queued back to back with no sync,
at a size where the GPU finishes each kernel sooner than the host issues the next, so the
wall time per call is the host's), and the GPU time per call at 4096x4096 (`gpu_us`, CUDA
events around 200 calls, so host gaps show when the host is slower than the kernel).

    python benchmarks/bench_host_overhead.py --out DIR   # writes DIR/host_overhead_CARD.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def host_us(fn, args, calls: int = 3000) -> float:
    """Median over 5 rounds of the wall time per call of `calls` calls issued back to back."""
    for _ in range(50):
        fn(*args)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(rounds)[2]


def gpu_us(fn, args, calls: int = 200) -> float:
    """Median over 5 rounds of the events' time per call of `calls` calls back to back."""
    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn(*args)
        b.record()
        torch.cuda.synchronize()
        rounds.append(a.elapsed_time(b) / calls * 1e3)
    return sorted(rounds)[2]


def rms_layers(x: torch.Tensor, w: torch.Tensor) -> dict[str, tuple[Any, tuple]]:
    from torch.library import wrap_triton

    from opswap.kernels import rms_norm as k
    from opswap.kernels._rows import jitted, rn_flag, row_settings

    eps = 1e-6
    m, n = x.shape
    y = torch.empty_like(x)
    block, warps = row_settings(n)
    kern = jitted(k._rms_fwd_fn)

    def launch(x, w, wrap=True):
        run = wrap_triton(kern) if wrap else kern
        run[(m,)](
            x, x, w, y, x, n, x.stride(0), x.stride(0), eps, 0.0,
            HAS_W=True, HAS_RES=False, CAST_FIRST=False, BLOCK=block,
            RN_X=rn_flag(x.dtype), RN_Y=rn_flag(y.dtype), num_warps=warps,
        )  # fmt: skip

    peer = torch.compile(lambda x, w: F.rms_norm(x, (n,), w, eps))
    return {
        "op": (torch.ops.opswap.rms_norm.default, (x, w, eps, 0.0, False)),
        "python fn": (getattr(k.rms_norm, "_init_fn", None) or k.rms_norm, (x, w, eps, 0.0, False)),
        "impl": (k.triton_forward, (x, w, eps, 0.0, False)),
        "launch": (launch, (x, w)),
        "jit": (lambda x, w: launch(x, w, wrap=False), (x, w)),
        "torch eager": (F.rms_norm, (x, (n,), w, eps)),
        "torch.compile": (peer, (x, w)),
    }


def ln_layers(x: torch.Tensor, w: torch.Tensor) -> dict[str, tuple[Any, tuple]]:
    from opswap.kernels import layer_norm as k

    n = x.shape[-1]
    b = torch.zeros_like(w)
    peer = torch.compile(lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5))
    return {
        "op": (torch.ops.opswap.layer_norm.default, (x, w, b, 1e-5)),
        "impl": (k.triton_forward, (x, w, b, 1e-5)),
        "torch eager": (F.layer_norm, (x, (n,), w, b, 1e-5)),
        "torch.compile": (peer, (x, w, b)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import datetime
    import platform

    import triton

    dev = "cuda"
    dt = torch.bfloat16
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": "bfloat16",
        "rows": [],
    }
    for kernel, layers in (("rms_norm", rms_layers), ("layer_norm", ln_layers)):
        small = (
            torch.randn(8, 4096, device=dev, dtype=dt),
            torch.randn(4096, device=dev, dtype=dt),
        )
        big = (
            torch.randn(4096, 4096, device=dev, dtype=dt),
            torch.randn(4096, device=dev, dtype=dt),
        )
        s_rows, b_rows = layers(*small), layers(*big)
        for name, (fn, a) in s_rows.items():
            row: dict[str, Any] = {"kernel": kernel, "layer": name}
            try:
                row["host_us"] = round(host_us(fn, a), 2)
                bf, ba = b_rows[name]
                row["gpu_us_4096x4096"] = round(gpu_us(bf, ba), 2)
            except Exception as e:  # a layer that cannot run here is reported, not fatal
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            res["rows"].append(row)
            print(row, flush=True)
    card = torch.cuda.get_device_name(0).split()[1].lower()
    path = args.out / f"host_overhead_{card}.json"
    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"{'kernel':<11} {'layer':<14} {'host us':>8} {'gpu us 4096^2':>14}")
    for r in res["rows"]:
        print(
            f"{r['kernel']:<11} {r['layer']:<14} {r.get('host_us', '-'):>8} "
            f"{r.get('gpu_us_4096x4096', r.get('error', '-'))!s:>14}"
        )
    print("wrote", path)


if __name__ == "__main__":
    main()
