"""Where opswap's FlashAttention spends its time at short sequences: the GPU time of each
kernel (torch.profiler), the host time of one call (launches queued without a sync), and
the call replayed as a CUDA graph (no host work), next to SDPA's flash and cuDNN
backends timed the same way. bench_attention.py's forward+backward at 1024 keys was
slower than at 2048 for our kernel (a floor near 1 ms), and this finds whether that floor
is the kernels or the host.

    python benchmarks/bench_flash_overhead.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from opswap.kernels import _flash_launch  # noqa: E402
from opswap.kernels.flash_attention import flash_attention  # noqa: E402

POINTS = [(1024, 64, False), (1024, 64, True), (2048, 64, False), (2048, 64, True)]
POINTS += [(1024, 128, False), (2048, 128, True), (4096, 64, True)]
B, H = 8, 16
#: the point whose forward+backward host time is profiled function by function
PROFILED = (2048, 64, True)


def _events(fn, iters: int = 30) -> float:
    """Median ms of fn over `iters` calls, each between two CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _host_ms(fn, iters: int = 40) -> float:
    """Host ms per call: `iters` calls queued back to back, timed before the sync."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t) / iters * 1e3
    torch.cuda.synchronize()
    return host


def _graph_ms(fn) -> float | None:
    """Median ms of fn replayed as one CUDA graph, or None where capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return _events(g.replay)
    except Exception as e:  # a capture the op does not allow
        print(f"graph capture failed: {str(e).splitlines()[0][:160]}", flush=True)
        return None


def _kernel_ms(fn, iters: int = 20) -> dict[str, float]:
    """GPU ms per call of each kernel fn launches, by kernel name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None)
        if dev is None:
            dev = getattr(e, "cuda_time_total", 0.0)
        if dev and e.key and not e.key.startswith(("cudaLaunch", "cuLaunch")):
            out[e.key[:60]] = out.get(e.key[:60], 0.0) + dev / 1e3 / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def _host_profile(fn, iters: int = 20) -> list[str]:
    """The host functions that take the most cumulative time over `iters` calls of fn
    (cProfile), as lines: where a host-bound call spends its milliseconds."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
    return [line.rstrip() for line in buf.getvalue().splitlines() if line.strip()][:45]


def _best_configs() -> dict[str, str]:
    out = {}
    for (name, interp), k in _flash_launch._KERNELS.items():
        cache = getattr(k, "cache", None)
        if cache and not interp:
            out[name] = "; ".join(f"{key[:3]} -> {cfg}" for key, cfg in list(cache.items())[:6])
    return out


def _point(s: int, d: int, causal: bool) -> dict:
    """One point's row."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(B, H, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    flops = 4 * B * H * s * s * d / (2 if causal else 1)
    o, lse = torch.ops.opswap.flash_attention(q, k, v, causal, scale, None, None)
    row: dict = {"seq": s, "head_dim": d, "causal": causal, "batch": B, "heads": H}

    def ours_fwd():
        return torch.ops.opswap.flash_attention(q, k, v, causal, scale, None, None)

    def ours_bwd():
        return torch.ops.opswap.flash_attention_backward(
            do, q, k, v, o, lse, causal, scale, None, None
        )

    def ours_fb():
        flash_attention(q, k, v, causal=causal).backward(do)

    def sdpa_fb(backend):
        def f():
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do)

        return f

    with torch.no_grad():
        row["ours_fwd_events_ms"] = _events(ours_fwd)
        row["ours_fwd_host_ms"] = _host_ms(ours_fwd)
        row["ours_fwd_graph_ms"] = _graph_ms(ours_fwd)
        row["ours_fwd_kernels_ms"] = _kernel_ms(ours_fwd)
        row["ours_bwd_events_ms"] = _events(ours_bwd)
        row["ours_bwd_host_ms"] = _host_ms(ours_bwd)
        row["ours_bwd_graph_ms"] = _graph_ms(ours_bwd)
        row["ours_bwd_kernels_ms"] = _kernel_ms(ours_bwd)
    row["ours_fb_events_ms"] = _events(ours_fb)
    row["ours_fb_host_ms"] = _host_ms(ours_fb)
    if (s, d, causal) == PROFILED:
        row["ours_fb_host_profile"] = _host_profile(ours_fb)
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        try:
            row[f"sdpa_{name}_fb_events_ms"] = _events(sdpa_fb(backend))
            row[f"sdpa_{name}_fb_host_ms"] = _host_ms(sdpa_fb(backend))
            row[f"sdpa_{name}_fb_kernels_ms"] = _kernel_ms(sdpa_fb(backend))
        except Exception as e:  # a backend that refuses the point
            row[f"sdpa_{name}_error"] = str(e).splitlines()[0][:160]
    for key in ("ours_fwd_graph_ms", "ours_fwd_events_ms"):
        if row.get(key):
            row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
    if row.get("ours_bwd_graph_ms"):
        row["ours_bwd_graph_tflops"] = 1.5 * flops / (row["ours_bwd_graph_ms"] * 1e-3) / 1e12
    return row


def run() -> dict:
    rows = []
    for s, d, causal in POINTS:
        row = _point(s, d, causal)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "device": torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "flops": "forward 4*B*H*S^2*D (halved for causal); backward 1.5x that",
        "rows": rows,
        "best_configs": _best_configs(),
    }


def main() -> None:
    global POINTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="the profiled point alone")
    a = ap.parse_args()
    if a.quick:
        POINTS = [PROFILED]
    if not torch.cuda.is_available():
        raise SystemExit("bench_flash_overhead needs a CUDA device; run it on the GPU machine.")
    res = run()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "flash_overhead_h200.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
