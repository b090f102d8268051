"""opswap's Triton RMSNorm, add + RMSNorm, LayerNorm, GroupNorm and SwiGLU against eager PyTorch,
torch.compile and Liger-Kernel, on a GPU (the lead runs it on the H200).

    PYTHONPATH=src python3 benchmarks/bench_norm_kernels.py --out DIR [--update-crossover]
    PYTHONPATH=src python3 benchmarks/bench_norm_kernels.py --smoke     (CPU, interpreter)

Shapes: [rows, 4096] for the norms and [rows, 5632] for SwiGLU (Llama-7B's hidden and
TinyLlama's intermediate size), rows 32768, 4096 and 256, bfloat16; GroupNorm as
[rows / 32, 128, 1024]: `rows` groups of 4096 elements, 32 groups a sample (F.group_norm
eager); forward alone and
forward + backward. Eager is the formula as HF writes it (LlamaRMSNorm; the residual add
then LlamaRMSNorm; F.layer_norm; F.silu(g) * u), torch.compile is that function compiled,
Liger-Kernel its own ops (imported lazily: skipped with a note when it is not installed).
Timed with triton.testing.do_bench (median of the repetitions, L2 flushed between them):
the call as eager code sees it, host included; and as CUDA-graph replays
(do_bench_cudagraph, `*_graph_ms`): the GPU's time alone. Effective GB/s counts the bytes
the op must read and write (below), next to a device copy's GB/s measured in the same
run. Writes DIR/norm_kernels_h200.json with the
device, versions and date; `--update-crossover` rewrites src/opswap/kernels/crossover.json
from the run. `--smoke` runs every path at tiny shapes on the CPU under TRITON_INTERPRET=1
(set before Triton is imported), to check the script itself.

Bytes counted (elements of x: n = rows * hidden, b = 2 bytes for bf16): RMSNorm and
LayerNorm forward 2 n b (x in, y out), backward 3 n b (x, dy in, dx out); add + RMSNorm
forward 4 n b (x, residual in, y, sum out), backward 4 n b (x, dy, dsum in, dx out);
SwiGLU forward 3 n b (g, u in, y out; n = rows * H), backward 5 n b; GroupNorm as LayerNorm.
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
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from opswap.kernels import crossover  # noqa: E402
from opswap.kernels import group_norm as GN  # noqa: E402
from opswap.kernels import layer_norm as L  # noqa: E402
from opswap.kernels import rms_norm as R  # noqa: E402
from opswap.kernels import swiglu as S  # noqa: E402

EPS = 1e-6
KERNELS = ("rms_norm", "add_rms_norm", "layer_norm", "group_norm", "swiglu")
#: group_norm's sweep: `rows` groups in all (GROUPS per sample) of `hidden` elements each
#: (4 channels of hidden / 4 positions, or 1 channel where 4 does not divide it)
GROUPS = 32
#: bytes per element of x read and written, (forward, backward), in units of the dtype's size
TRAFFIC = {
    "rms_norm": (2, 3),
    "add_rms_norm": (4, 4),
    "layer_norm": (2, 3),
    "group_norm": (2, 3),
    "swiglu": (3, 5),
}


# ----------------------------------------------------------------------------- the functions


def eager_rms(x, w):
    """LlamaRMSNorm.forward as HF writes it."""
    xf = x.to(torch.float32)
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def eager_add_rms(x, r, w):
    s = x + r
    return eager_rms(s, w), s


def eager_ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def eager_gn(x, w, b):
    return F.group_norm(x, GROUPS, w, b, EPS)


def eager_swiglu(g, u):
    return F.silu(g) * u


def ours(kernel):
    return {
        "rms_norm": lambda x, w: R.rms_norm(x, w, EPS, 0.0, True),
        "add_rms_norm": lambda x, r, w: R.add_rms_norm(x, r, w, EPS, 0.0, True),
        "layer_norm": lambda x, w, b: L.layer_norm(x, w, b, EPS),
        "group_norm": lambda x, w, b: GN.group_norm(x, GROUPS, w, b, EPS),
        "swiglu": lambda g, u: S.glu(g, u, "silu"),
    }[kernel]


def eager(kernel):
    return {
        "rms_norm": eager_rms,
        "add_rms_norm": eager_add_rms,
        "layer_norm": eager_ln,
        "group_norm": eager_gn,
        "swiglu": eager_swiglu,
    }[kernel]


def liger(kernel):
    """Liger-Kernel's op for `kernel`, or (None, why)."""
    try:
        if kernel == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama"), ""
        if kernel == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS), ""
        if kernel == "group_norm":
            from liger_kernel.ops.group_norm import LigerGroupNormFunction

            return (
                lambda x, w, b: LigerGroupNormFunction.apply(x, w, b, x.shape[1], GROUPS, EPS),
                "",
            )
        if kernel == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return lambda g, u: LigerSiLUMulFunction.apply(g, u), ""
        if kernel == "add_rms_norm":
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

            return (
                lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama"),
                "",
            )
    except Exception as e:  # not installed, or another version's API
        return None, f"Liger-Kernel not used for {kernel}: {type(e).__name__}: {e}"
    return None, f"no Liger-Kernel op for {kernel}"


def inputs(kernel, rows, hidden, dtype, device, grad):
    g = torch.Generator(device=device).manual_seed(rows + hidden)

    def t(*shape, scale=1.0, shift=0.0):
        v = torch.randn(*shape, generator=g, device=device) * scale + shift
        return v.to(dtype).requires_grad_(grad)

    if kernel == "rms_norm":
        return (t(rows, hidden), t(hidden, scale=0.1, shift=1.0))
    if kernel == "add_rms_norm":
        return (t(rows, hidden), t(rows, hidden), t(hidden, scale=0.1, shift=1.0))
    if kernel == "layer_norm":
        return (t(rows, hidden), t(hidden, scale=0.1, shift=1.0), t(hidden, scale=0.1))
    if kernel == "group_norm":
        per = 4 if hidden % 4 == 0 else 1  # channels per group
        c = GROUPS * per
        x = t(max(1, rows // GROUPS), c, hidden // per)
        return (x, t(c, scale=0.1, shift=1.0), t(c, scale=0.1))
    return (t(rows, hidden), t(rows, hidden))


# ----------------------------------------------------------------------------- timing


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _step(fn, args, backward):
    """A callable running fn (and, with `backward`, its backward from fixed gradients)."""
    if not backward:
        return lambda: fn(*args)
    out = fn(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    grads = [torch.randn_like(o) for o in outs]

    def run():
        o = fn(*args)
        o = o if isinstance(o, (tuple, list)) else (o,)
        torch.autograd.backward(list(o), grads)

    return run


def time_row(r: dict, fns: dict, args, backward, nbytes, device, smoke) -> dict:
    """Row `r` with each of `fns` timed on `args` (forward, or forward + backward): its
    ms and effective GB/s over `nbytes`, or the error that stopped it; printed as it is."""
    for name, fn in fns.items():
        try:
            ms = time_ms(_step(fn, args, backward), args, device, smoke)
            r[f"{name}_ms"] = ms
            r[f"{name}_gbps"] = nbytes / (ms * 1e-3) / 1e9
        except Exception as e:
            r[f"{name}_ms"] = None
            r[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        gms = graph_ms(_step(fn, args, backward), args, device, smoke) if r[f"{name}_ms"] else None
        r[f"{name}_graph_ms"] = gms
        r[f"{name}_graph_gbps"] = nbytes / (gms * 1e-3) / 1e9 if gms else None
    print(json.dumps({k: v for k, v in r.items() if not k.endswith("gbps")}), flush=True)
    return r


def time_ms(run, args, device, smoke) -> float:
    if smoke or device != "cuda":
        run()
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    leaves = [a for a in args if a.requires_grad]
    return float(triton.testing.do_bench(run, grad_to_none=leaves, return_mode="median"))


def graph_ms(run, args, device, smoke) -> float | None:
    """The GPU time of `run` without the host's: calls captured in a CUDA graph and replayed
    (triton.testing.do_bench_cudagraph, median); None on the CPU or where capture fails.
    The host of the H200 machine takes tens of microseconds an op, so a call that launches
    little work is timed by its host in `time_ms`; this is what the kernels take."""
    if smoke or device != "cuda":
        return None
    import triton.testing

    leaves = [a for a in args if a.requires_grad]
    try:
        return float(
            triton.testing.do_bench_cudagraph(run, grad_to_none=leaves, return_mode="median")
        )
    except Exception:  # a capture a path refuses (a host sync): no GPU-only time for it
        torch.cuda.synchronize()
        return None


def copy_gbps(device, smoke) -> float:
    n = (1 << 12) if smoke else (1 << 29)  # 1 GiB of bf16
    x = torch.empty(n, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), (), device, smoke)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


def row(kernel, rows, hidden, dtype, device, smoke, compiled, notes) -> list[dict]:
    out = []
    peer, why = liger(kernel) if device == "cuda" else (None, "Liger-Kernel needs CUDA")
    if why and why not in notes:
        notes.append(why)
    elt = torch.empty((), dtype=dtype).element_size()
    for p, backward in (("forward", False), ("forward+backward", True)):
        args = inputs(kernel, rows, hidden, dtype, device, backward)
        fns = {"ours": ours(kernel), "eager": eager(kernel), "compile": compiled[kernel]}
        if peer is not None:
            fns["liger"] = peer
        with torch.no_grad():
            ref = _first(eager(kernel)(*args)).float()
            err = float((_first(ours(kernel)(*args)).float() - ref).norm() / ref.norm())
        r = {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), "rows": rows}
        r.update({"hidden": hidden, "pass": p, "rel_l2_ours_vs_eager": err})
        fwd, bwd = TRAFFIC[kernel]
        nbytes = (fwd + (bwd if backward else 0)) * rows * hidden * elt
        r["bytes"] = nbytes
        out.append(time_row(r, fns, args, backward, nbytes, device, smoke))
    return out


def env(device) -> dict:
    d = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "device_class": crossover.device_class(torch.device(device)) if device == "cuda" else "",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    for mod in ("triton", "liger_kernel"):
        try:
            d[mod] = __import__(mod).__version__
        except Exception:
            d[mod] = None
    return d


#: the width sweep's rows (the issue's sweep: widths 768 to 16384, non-powers of two in it)
WIDTH_ROWS = 4096


def run(
    smoke: bool = False, kernels: tuple[str, ...] = KERNELS, widths: tuple[int, ...] = ()
) -> dict:
    """Every kernel at the default shapes, or, with `widths`, at WIDTH_ROWS rows of each
    width (GroupNorm's groups of that many elements)."""
    device = "cpu" if smoke else "cuda"
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise SystemExit(f"unknown kernels {sorted(unknown)}; pick from {', '.join(KERNELS)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --smoke for the CPU check")
    dtype = torch.bfloat16
    rows_list = (3,) if smoke else (256, 4096, 32768)
    hidden = {"swiglu": 48 if smoke else 5632}
    res: dict = {**env(device), "notes": [], "rows": []}
    res["copy_gbps"] = copy_gbps(device, smoke)
    compiled = {k: (eager(k) if smoke else torch.compile(eager(k))) for k in kernels}
    if smoke:
        res["notes"].append("smoke: eager stands in for torch.compile (no GPU)")
    shapes = [(r, None) for r in rows_list]
    if widths:
        shapes = [(3 if smoke else WIDTH_ROWS, min(w, 96) if smoke else w) for w in widths]
    for kernel in kernels:
        for rows, width in shapes:
            if kernel == "group_norm":  # whole samples of GROUPS groups
                rows = max(GROUPS, rows - rows % GROUPS)
            try:
                res["rows"] += row(
                    kernel,
                    rows,
                    width or hidden.get(kernel, 64 if smoke else 4096),
                    dtype,
                    device,
                    smoke,
                    compiled,
                    res["notes"],
                )
            except Exception:
                res["notes"].append(
                    f"{kernel} at {rows} rows failed: {traceback.format_exc()[-800:]}"
                )
    return res


def main() -> None:
    from _results import kernel_main

    kernel_main(run, "norm_kernels")


if __name__ == "__main__":
    main()
