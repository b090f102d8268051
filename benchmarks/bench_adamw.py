"""Fused AdamW: one optimizer step over the parameter list of a ~1.2 B-parameter Llama-style
model (embedding 128256 x 2048, 16 layers of attention and MLP weights, norms), for
torch.optim.AdamW with foreach=True, torch's fused=True and opswap.train.optim.AdamW, on a
GPU (the lead runs it), for float32 and for bf16 parameters; --smoke times the same three
on the CPU (opswap's step in the Triton interpreter: it checks the kernel runs, its time
means nothing).

    PYTHONPATH=src python3 benchmarks/bench_adamw.py --out DIR
    PYTHONPATH=src python3 benchmarks/bench_adamw.py --smoke      (CPU, the interpreter)

Timed: `opt.step()` with the gradients in place (triton.testing.do_bench, median). GB/s
counts the bytes a one-pass step must move: read param, grad, exp_avg, exp_avg_sq and write
param, exp_avg, exp_avg_sq: 28 bytes a float32 parameter. torch keeps a bf16 parameter's
states in bf16 (14 bytes), opswap in float32 (22 bytes), so each row carries its own
byte count (`bytes_per_param`). After the timing each
optimizer's parameters are compared with foreach's after the same number of steps from the
same start (max abs difference). Writes DIR/adamw_<card>.json (adamw_smoke.json).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import datetime as dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from opswap.train.optim import AdamW  # noqa: E402


def shapes(smoke: bool) -> list[tuple[int, ...]]:
    """The parameter shapes: a Llama-3.2-1B-like list (1.24 B), or a tiny one."""
    if smoke:
        return [(500, 32), (32,), (96, 32), (32, 96), (7,)] * 2
    d, kv, ff, layers = 2048, 512, 8192, 16
    out: list[tuple[int, ...]] = [(128256, d)]
    for _ in range(layers):
        out += [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff), (d,), (d,)]
    return out + [(d,)]


def make_params(smoke: bool, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    ps = []
    for s in shapes(smoke):
        p = torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype)
        p.requires_grad_()
        p.grad = torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype) * 1e-2
        ps.append(p)
    return ps


def optimizers(
    dtype: torch.dtype, device: str
) -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    kw = {"lr": 1e-3, "weight_decay": 0.1}
    out: dict[str, Callable[[list], torch.optim.Optimizer]] = {
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **kw),
        "opswap": lambda ps: AdamW(ps, **kw),
    }
    # torch's fused step: a CUDA kernel on the GPU, a vectorised loop on the CPU (torch >= 2.4)
    out["torch_fused"] = lambda ps: torch.optim.AdamW(ps, fused=True, **kw)
    return out


def bytes_per_param(name: str, dtype: torch.dtype) -> int:
    """What one step must move per parameter: param and grad in their dtype, the two states
    (float32 in opswap's AdamW, the param's dtype in torch's), each state read and written,
    the param read and written, the grad read."""
    p = torch.empty((), dtype=dtype).element_size()
    s = 4 if name == "opswap" else p
    return 3 * p + 4 * s


def time_ms(step: Callable[[], object], device: str, smoke: bool) -> float:
    if device != "cuda":
        step()
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(step, return_mode="median"))


def run(smoke: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        n = sum(torch.Size(s).numel() for s in shapes(smoke))
        finals: dict[str, list[torch.Tensor]] = {}
        for name, make in optimizers(dtype, device).items():
            r: dict = {"name": name, "dtype": str(dtype)[6:], "params": n}
            try:
                ps = make_params(smoke, dtype, device)
                opt = make(ps)
                ms = time_ms(opt.step, device, smoke)
                r["ms"] = ms
                r["bytes_per_param"] = bytes_per_param(name, dtype)
                r["gbps"] = n * r["bytes_per_param"] / (ms * 1e-3) / 1e9
                # the same number of steps from the same start for every optimizer: compared
                fresh = make_params(smoke, dtype, device)
                o2 = make(fresh)
                for _ in range(3):
                    o2.step()
                finals[name] = [p.detach().float().cpu() for p in fresh]
                del ps, opt, fresh, o2
            except Exception as e:  # a peer failing must not lose the run
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append(r)
        base = finals.get("torch_foreach")
        for r in rows:
            if r["dtype"] == str(dtype)[6:] and base is not None and r["name"] in finals:
                r["max_abs_diff_vs_foreach_3_steps"] = max(
                    float((a - b).abs().max()) for a, b in zip(finals[r["name"]], base, strict=True)
                )
            if r["dtype"] == str(dtype)[6:]:
                print(json.dumps(r), flush=True)
    by = {(r["name"], r["dtype"]): r for r in rows if "ms" in r}
    summary = {}
    for dt_ in ("float32", "bfloat16"):
        for peer in ("torch_foreach", "torch_fused"):
            if (peer, dt_) in by and ("opswap", dt_) in by:
                summary[f"{dt_}_speedup_vs_{peer}"] = (
                    by[(peer, dt_)]["ms"] / by[("opswap", dt_)]["ms"]
                )
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "smoke": smoke,
        # the same run's peers: torch.optim.AdamW with foreach=True and with fused=True
        "peer": "torch.optim.AdamW foreach=True and fused=True, same run (rows torch_foreach, "
        "torch_fused)",
        "rows": rows,
        "summary": summary,
    }


def main() -> None:
    import argparse

    from _results import write_kernel_run

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreter")
    args = ap.parse_args()
    write_kernel_run(run(args.smoke), args.out, "adamw", args.smoke, False)


if __name__ == "__main__":
    main()
