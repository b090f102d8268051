"""Fused linear + cross-entropy, forward + backward: opswap's op against the logits written
out (eager, and torch.compile of the same loss, with and without Inductor's auto-chunker),
torch's own chunked `F.linear_cross_entropy` (torch 2.13+), Liger-Kernel's
LigerFusedLinearCrossEntropyLoss and cut-cross-entropy's `linear_cross_entropy` (each
where importable; "not installed" otherwise). Time and peak memory on a GPU (the lead runs
it), the loss's and gradients' error against a float32 reference.

    PYTHONPATH=src python3 benchmarks/bench_lce.py --out DIR       (GPU: N=8192, H=4096,
                                                                  V=128256, bf16)
    PYTHONPATH=src python3 benchmarks/bench_lce.py --smoke         (CPU, the interpreter)
    PYTHONPATH=src python3 benchmarks/bench_lce.py --cpu           (CPU path, N=1024,
                                                                  H=256, V=32000, fp32)

Timed: `loss(h, W, t).backward()` with h and W needing gradients (triton.testing.do_bench,
median, gradients set to None between repetitions; on the CPU the median of three calls).
Peak memory: the most allocated during one call beyond what the inputs hold (on the CPU,
the resident set's growth). TFLOP/s counts the three GEMMs any method must run
(logits, dh, dW: 6 N H V flops). A tenth of the targets are ignore_index (-100).
Writes DIR/lce_<card>.json (lce_smoke.json with --smoke).
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
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from opswap.train.losses import linear_cross_entropy  # noqa: E402

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def eager(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The loss as a model writes it: logits in the model's dtype, upcast, cross-entropy."""
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def ours(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return linear_cross_entropy(h, w, t)


def peers() -> tuple[dict[str, Loss], dict[str, str]]:
    """{name: loss} of the peers that import, and {name: why not} of the others."""
    fns: dict[str, Loss] = {}
    missing: dict[str, str] = {}
    opts = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if opts is not None and hasattr(F, "linear_cross_entropy"):
        o = opts()
        fns["torch_chunked"] = lambda h, w, t: F.linear_cross_entropy(
            h, w, t, ignore_index=-100, options=o
        )
    else:
        missing["torch_chunked"] = f"torch {torch.__version__} has no chunked linear_cross_entropy"
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        fns["liger"] = lambda h, w, t: liger(w, h, t)
    except Exception as e:  # ImportError, or a Liger that needs what is not here
        missing["liger"] = f"not installed ({type(e).__name__}: {str(e)[:120]})"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        fns["cut_cross_entropy"] = lambda h, w, t: cce(h, w, t, ignore_index=-100)
    except Exception as e:
        missing["cut_cross_entropy"] = f"not installed ({type(e).__name__}: {str(e)[:120]})"
    return fns, missing


def compiled(fn: Loss, autochunk: bool = False) -> Loss:
    """torch.compile of `fn`; with `autochunk`, compiled while Inductor's auto-chunker (which
    splits a large-intermediate matmul + reduction into chunks) is on."""
    c = torch.compile(fn)
    if not autochunk:
        return c
    import torch._inductor.config as ic

    if not hasattr(ic, "auto_chunker"):
        raise RuntimeError(f"torch {torch.__version__}'s Inductor has no auto_chunker")
    done: list[bool] = []

    def run(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if not done:  # compiled at the first call: the setting must hold then
            done.append(True)
            with ic.patch({"auto_chunker.enable": True}):
                return c(h, w, t)
        return c(h, w, t)

    return run


def inputs(n: int, hdim: int, v: int, dtype: torch.dtype, device: str) -> tuple:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hdim, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, hdim, generator=g) / hdim**0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.1] = -100
    return h, w, t.to(device)


def reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
    """(loss, dh, dW) in float32 with the logits written out."""
    hf = h.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    loss = F.cross_entropy(F.linear(hf, wf), t, ignore_index=-100)
    loss.backward()
    return [loss.detach(), hf.grad, wf.grad]


def errors(fn: Loss, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, ref: list) -> dict:
    h.grad = w.grad = None
    loss = fn(h, w, t)
    loss.backward()
    got = [loss.detach(), h.grad, w.grad]
    h.grad = w.grad = None
    names = ("loss", "dh", "dw")
    return {
        f"rel_err_{k}": float((a.double() - b.double()).norm() / b.double().norm())
        for k, a, b in zip(names, got, ref, strict=True)
    }


def time_ms(fn: Loss, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, device: str) -> float:
    def step() -> None:
        fn(h, w, t).backward()

    if device != "cuda":
        step()
        ts = []
        for _ in range(3):
            h.grad = w.grad = None
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[1] * 1e3
    import triton.testing

    return float(triton.testing.do_bench(step, grad_to_none=[h, w], return_mode="median"))


def _rss_peak_mb(fn: Loss, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> float | None:
    """On Linux: the resident set's high-water mark during one call beyond the resident
    size before it (freed heap handed back first, the mark reset through clear_refs)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None

    def status(key: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 1024
        raise KeyError(key)

    base = status("VmRSS:")
    fn(h, w, t).backward()
    peak = status("VmHWM:") - base
    h.grad = w.grad = None
    return peak


def peak_mb(
    fn: Loss, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, device: str
) -> float | None:
    """The most memory allocated during one forward + backward beyond what was allocated
    before it (the inputs), in MB; the gradients it leaves are counted. On the CPU the
    resident set's growth instead (None in the interpreter, whose figures mean nothing)."""
    if device != "cuda":
        smoke = os.environ.get("TRITON_INTERPRET") == "1"
        return None if smoke else _rss_peak_mb(fn, h, w, t)
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(h, w, t).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    h.grad = w.grad = None
    return peak / 2**20


def env(device: str) -> dict:
    d: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    for mod in ("triton", "liger_kernel", "cut_cross_entropy"):
        try:
            d[mod] = getattr(__import__(mod), "__version__", "installed")
        except Exception:
            d[mod] = None
    return d


def run(smoke: bool, cpu: bool = False) -> dict:
    device = "cuda" if torch.cuda.is_available() and not (smoke or cpu) else "cpu"
    n, hdim, v = (48, 32, 500) if smoke else (1024, 256, 32000) if cpu else (8192, 4096, 128256)
    dtype = torch.float32 if smoke or cpu else torch.bfloat16
    h, w, t = inputs(n, hdim, v, dtype, device)
    ref = reference(h, w, t)
    fns: dict[str, Loss] = {"eager": eager, "opswap": ours}
    notes: dict[str, str] = {}
    for name, make in (
        ("compile", lambda: compiled(eager)),
        ("compile_autochunk", lambda: compiled(eager, autochunk=True)),
        ("opswap_compile", lambda: torch.compile(ours, fullgraph=True)),
    ):
        try:
            fns[name] = make()
        except Exception as e:
            notes[name] = f"{type(e).__name__}: {str(e)[:200]}"
    more, missing = peers()
    fns.update(more)
    notes.update(missing)
    flops = 6 * n * hdim * v
    rows = []
    for name, fn in fns.items():
        r: dict = {"name": name, "n": n, "hidden": hdim, "vocab": v, "dtype": str(dtype)[6:]}
        try:
            r.update(errors(fn, h, w, t, ref))
            r["ms"] = time_ms(fn, h, w, t, device)
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
            r["peak_mb"] = peak_mb(fn, h, w, t, device)
        except Exception as e:  # a peer failing must not lose the run
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if device == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)
        rows.append(r)
    by = {r["name"]: r for r in rows if "ms" in r}
    summary = {}
    for peer in ("eager", "compile", "compile_autochunk", "torch_chunked", "liger"):
        if peer in by and "opswap" in by:
            summary[f"speedup_vs_{peer}"] = by[peer]["ms"] / by["opswap"]["ms"]
            if by[peer]["peak_mb"]:
                summary[f"peak_ratio_vs_{peer}"] = by["opswap"]["peak_mb"] / by[peer]["peak_mb"]
    return {**env(device), "flops": flops, "rows": rows, "summary": summary, "notes": notes}


def main() -> None:
    import argparse

    from _results import write_kernel_run

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreter")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="the CPU path at N=1024, H=256, V=32000, fp32 (writes lce_cpu.json)",
    )
    args = ap.parse_args()
    if args.cpu:
        from _results import write_results

        res = run(False, cpu=True)
        rows = res.pop("rows")
        write_results(args.out, "lce_cpu.json", res.pop("device"), rows, **res)
        return
    write_kernel_run(run(args.smoke), args.out, "lce", args.smoke, False)


if __name__ == "__main__":
    main()
