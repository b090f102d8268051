"""Where the backward time of opswap's row kernels goes, next to Liger-Kernel's and
torch.compile's: the backward pass timed alone, and each CUDA kernel a forward + backward
launches with its GPU time (torch.profiler), on a GPU (the lead runs it on the H200;
about a minute).

    PYTHONPATH=src python3 benchmarks/bench_row_backward.py --out DIR [--sweep] [--host]
    PYTHONPATH=src python3 benchmarks/bench_row_backward.py --smoke   (CPU, interpreter)

Cases (bfloat16, [32768, 4096]; SwiGLU [32768, 5632]): RMSNorm, add + RMSNorm,
LayerNorm, SwiGLU, softmax and log_softmax. The backward alone is timed by replaying
`torch.autograd.backward(out, grads, retain_graph=True)` on one recorded forward
(triton.testing.do_bench, median, L2 flushed); its effective GB/s counts what the backward
must read and write (RMSNorm and LayerNorm 3 n b: x, dy in, dx out; add + RMSNorm 4 n b;
SwiGLU 5 n b; softmax 3 n b: y, dy in, dx out). Writes DIR/row_backward_h200.json.

`--sweep` also times the RMSNorm, add + RMSNorm and LayerNorm backward kernels alone (GPU
time: CUDA-graph replays, since the host is slower than the kernels) at 4096 and 32768
rows of 768 to 16384 elements for each launch choice (rows a step, programs a
multiprocessor: kernels/_rows.py `backward_grid`), the data behind its defaults. `--host`
measures what a forward + backward costs the host: at 8 rows the GPU work is a few
microseconds, so the wall time of a call is the host's, for ours, Liger's, compile's and
eager's, with a cProfile of ours.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_kernels18 as K18  # noqa: E402
import bench_norm_kernels as NK  # noqa: E402

#: case -> backward bytes per element of x, in units of the dtype's size
BACKWARD_TRAFFIC = {
    "rms_norm": 3,
    "add_rms_norm": 4,
    "layer_norm": 3,
    "swiglu": 5,
    "softmax": 3,
    "log_softmax": 3,
}


def _fns(case: str, device: str):
    """{impl: fn} and the inputs' maker for one case."""
    if case in NK.KERNELS:
        fns = {"ours": NK.ours(case), "eager": NK.eager(case)}
        peer = NK.liger(case)[0] if device == "cuda" else None

        def make(rows, hidden, grad):
            return NK.inputs(case, rows, hidden, torch.bfloat16, device, grad)

    else:
        _, ours, eager, _ = K18.CASES[case]
        fns = {"ours": ours, "eager": eager}
        peer = K18.liger(case)[0] if device == "cuda" else None

        def make(rows, hidden, grad):
            return K18.inputs(case, (rows, hidden), torch.bfloat16, device, grad)

    if peer is not None:
        fns["liger"] = peer
    if device == "cuda":
        fns["compile"] = torch.compile(fns["eager"])
    return fns, make


def _profile(run, device: str) -> list[dict]:
    """Each CUDA kernel of one call of `run`: name, count and GPU time in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        run()
        if device == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if device == "cuda" and t <= 0:
            continue
        rows.append({"name": e.key[:120], "count": e.count, "gpu_us": round(t, 1)})
    return sorted(rows, key=lambda r: -r["gpu_us"])[:12]


def case_rows(case: str, rows: int, hidden: int, device: str, smoke: bool) -> list[dict]:
    fns, make = _fns(case, device)
    elt = 2
    nbytes = BACKWARD_TRAFFIC[case] * rows * hidden * elt
    out = []
    for impl, fn in fns.items():
        r: dict = {"case": case, "impl": impl, "rows": rows, "hidden": hidden, "bytes": nbytes}
        try:
            args = make(rows, hidden, True)
            leaves = [a for a in args if a.requires_grad]
            o = fn(*args)
            outs = list(o) if isinstance(o, (tuple, list)) else [o]
            grads = [torch.randn_like(t) for t in outs]

            def bwd(outs=outs, grads=grads):
                torch.autograd.backward(outs, grads, retain_graph=True)

            if smoke or device != "cuda":
                bwd()
                r["backward_ms"] = None
            else:
                import triton.testing

                ms = triton.testing.do_bench(bwd, grad_to_none=leaves, return_mode="median")
                r["backward_ms"] = float(ms)
                r["backward_gbps"] = nbytes / (ms * 1e-3) / 1e9
            fb = NK._step(fn, args, True)
            fb()
            r["kernels_fwd_bwd"] = _profile(fb, device)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            r["traceback"] = traceback.format_exc()[-1500:]
        print(
            json.dumps({k: v for k, v in r.items() if k not in ("kernels_fwd_bwd", "traceback")}),
            flush=True,
        )
        for k in r.get("kernels_fwd_bwd", [])[:6]:
            print("   ", k, flush=True)
        out.append(r)
    return out


#: the sweep's row counts and widths: the width sweep's 4096 rows, where the partial weight
#: gradients are a larger share of the bytes (at 8192 wide, 4 programs a multiprocessor
#: write and read back 17 MB of fp32 partials beside the 201 MB of x, dy and dx), and the
#: 32768 rows the defaults were set at
SWEEP_ROWS = (4096, 32768)
SWEEP_WIDTHS = (768, 2048, 3072, 5120, 8192, 16384)


def sweep(device: str, smoke: bool, rows_list: tuple[int, ...] = SWEEP_ROWS) -> list[dict]:
    """The backward kernels alone at each (rb, per_sm), GB/s over the bytes they move (the
    fp32 partials of dw and db not counted: they are the launch's own cost)."""
    from opswap.kernels import layer_norm as L
    from opswap.kernels import rms_norm as R
    from opswap.kernels._rows import backward_tuning
    from opswap.kernels.crossover import device_class

    dev_class = device_class(torch.device(device))
    out = []
    shapes = (
        [(6, h) for h in (48, 200)] if smoke else [(r, h) for r in rows_list for h in SWEEP_WIDTHS]
    )
    for case in ("rms_norm", "add_rms_norm", "layer_norm"):
        for rows, hidden in shapes:
            x, w = (torch.randn(rows, hidden, device=device, dtype=torch.bfloat16) for _ in "ab")
            w = w[0].clone()
            dy, dres = torch.randn_like(x), torch.randn_like(x)
            dr = dres if case == "add_rms_norm" else None

            def fn(case=case, dy=dy, x=x, w=w, dr=dr):
                if case == "layer_norm":
                    return L.triton_backward(dy, x, w, 1e-6)
                return R.triton_backward(dy, x, w, dr, 1e-6, 0.0, True)

            nbytes = BACKWARD_TRAFFIC[case] * rows * hidden * 2
            for rb in (1, 2, 4):
                for per_sm in (1, 2, 4, 8):
                    r = {"case": case, "hidden": hidden, "rows": rows, "rb": rb, "per_sm": per_sm}
                    r["device"] = dev_class
                    try:
                        with backward_tuning(rb=rb, per_sm=per_sm):
                            fn()
                            ms = NK.graph_ms(fn, (), device, smoke)
                        r["ms"] = ms
                        r["gbps"] = nbytes / (ms * 1e-3) / 1e9 if ms else None
                    except Exception as e:
                        r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    out.append(r)
            best = max(
                (r for r in out[-12:] if r.get("gbps")), key=lambda r: r["gbps"], default=None
            )
            print(
                json.dumps({"case": case, "rows": rows, "hidden": hidden, "best": best}),
                flush=True,
            )
            del x, w, dy, dres
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


def host(device: str, smoke: bool) -> list[dict]:
    """Wall time of a forward + backward at 8 rows (host-bound), and a cProfile of ours."""
    import cProfile
    import io
    import pstats
    import time

    from opswap.kernels import rms_norm as R

    def raw_rms(x, w):
        """RMSNorm's two launches without torch.library or autograd: what the kernels
        alone cost the host."""
        y, _ = R.triton_forward(x.detach(), w.detach(), 1e-6, 0.0, True)
        R.triton_backward(y, x.detach(), w.detach(), None, 1e-6, 0.0, True)

    out = []
    for case in ("rms_norm", "layer_norm", "softmax"):
        fns, make = _fns(case, device)
        if case == "rms_norm":
            fns["ours_raw_launches"] = raw_rms
        for impl, fn in fns.items():
            r: dict = {"case": case, "impl": impl, "rows": 8, "hidden": 64 if smoke else 4096}
            try:
                args = make(8, r["hidden"], True)
                step = (
                    (lambda fn=fn, args=args: fn(*args))
                    if impl == "ours_raw_launches"
                    else NK._step(fn, args, True)
                )
                for _ in range(3 if smoke else 20):
                    step()
                n = 5 if smoke else 200
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    step()
                if device == "cuda":
                    torch.cuda.synchronize()
                r["us_per_fwd_bwd"] = (time.perf_counter() - t0) / n * 1e6
                if impl == "ours":
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(n):
                        step()
                    prof.disable()
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
                    r["profile"] = buf.getvalue().splitlines()[-26:]
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
            out.append(r)
    return out


#: shapes timed against Liger and compile after the sweep (the table's launch in use):
#: 4096 rows, where the width sweep had the norms' backward behind Liger's
AFTER_SWEEP = ((4096, 3072), (4096, 8192))


def run(
    smoke: bool = False,
    do_sweep: bool = False,
    do_host: bool = False,
    table: bool = False,
    sweep_rows: tuple[int, ...] = SWEEP_ROWS,
) -> dict:
    device = "cpu" if smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --smoke for the CPU check")
    res: dict = {**NK.env(device), "notes": [], "rows": []}
    res["copy_gbps"] = NK.copy_gbps(device, smoke)
    if do_sweep:
        res["sweep"] = sweep(device, smoke, sweep_rows)
        if table:
            apply_sweep(res["sweep"], "bench_row_backward --sweep " + res.get("date", ""))
            res["notes"].append("the rows below ran with the launch table this sweep wrote")
    rows = 3 if smoke else 32768
    for case in BACKWARD_TRAFFIC:
        hidden = (48 if smoke else 5632) if case == "swiglu" else (64 if smoke else 4096)
        res["rows"] += case_rows(case, rows, hidden, device, smoke)
        if device == "cuda":
            torch.cuda.empty_cache()
    if do_sweep:
        for rows, hidden in [(5, 200)] if smoke else AFTER_SWEEP:
            for case in ("rms_norm", "add_rms_norm", "layer_norm"):
                res["rows"] += case_rows(case, rows, hidden, device, smoke)
    if do_host:
        res["host"] = host(device, smoke)
    return res


def apply_sweep(sweep_rows: list[dict], source: str) -> list[dict]:
    """Write the launch each shape class measured best into kernels/backward_launch.json."""
    from opswap.kernels._rows import pick_backward_launches, update_backward_launches

    entries = pick_backward_launches(sweep_rows)
    update_backward_launches(entries, source)
    for e in entries:
        print(json.dumps(e), flush=True)
    return entries


def main() -> None:
    import argparse

    from _results import write_kernel_run

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreter")
    ap.add_argument("--sweep", action="store_true", help="time each backward launch choice")
    ap.add_argument(
        "--update-table",
        action="store_true",
        help="with --sweep: write the best launch per shape class into the package's table",
    )
    ap.add_argument(
        "--apply", type=Path, help="write the table from a committed run's JSON (no GPU)"
    )
    ap.add_argument("--host", action="store_true", help="the host's cost of a call")
    ap.add_argument(
        "--sweep-rows",
        default=",".join(map(str, SWEEP_ROWS)),
        help="the sweep's row counts, comma-separated",
    )
    args = ap.parse_args()
    if args.apply:
        data = json.loads(args.apply.read_text())
        if not data.get("sweep"):
            raise SystemExit(f"{args.apply} holds no sweep: run with --sweep to make one")
        apply_sweep(data["sweep"], f"{args.apply.name} ({data.get('date', '')})")
        return
    rows = tuple(int(r) for r in args.sweep_rows.split(","))
    res = run(args.smoke, args.sweep, args.host, args.update_table and not args.smoke, rows)
    write_kernel_run(res, args.out, "row_backward", args.smoke, False)


if __name__ == "__main__":
    main()
