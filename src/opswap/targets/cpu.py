"""The 'cpu' target: this machine's ceilings, measured once and cached.

No datasheet describes "whatever CPU the user runs on", so the ceilings are
measured with two short micro-benchmarks (about a second and a half in all):

- peak FLOP/s: the best of several 1024x1024x1024 float32 matmuls (2 * 1024**3
  FLOP each) on the threads torch uses;
- int8 OP/s: the same matmul in int8 through `torch._int_mm` (what the int8 rules run);
- bandwidth: the best of a 64 MiB copy (read 64 MiB + write 64 MiB) and a 64 MiB
  add (read 2 x 64 MiB + write 64 MiB). Bytes are counted as the cost model
  counts them (read + written), so write-allocate traffic is not included.

The result is cached as JSON in `$OPSWAP_CACHE_DIR/cpu_target.json` (default
`$XDG_CACHE_HOME/opswap` or `~/.cache/opswap`), keyed by CPU model, CPU and
thread count and torch version; `get_cpu_target(refresh=True)` measures again.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path
from typing import Literal

import torch

from opswap.targets.base import Target

CACHE_FILE = "cpu_target.json"

_MATMUL_N = 1024
_COPY_BYTES = 64 * 2**20
_BUDGET_S = 0.6  # per micro-benchmark, after one warm-up run


def cache_dir() -> Path:
    """Where opswap caches measurements: $OPSWAP_CACHE_DIR, else the user cache dir."""
    env = os.environ.get("OPSWAP_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "opswap"


def cpu_model() -> str:
    """The CPU's marketing name, e.g. 'Intel(R) Xeon(R) Platinum 8480+'."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


#: bumped whenever the measurements change (v2: dispatch costs, v3: int8 OP/s), so that an
#: entry measured by an older opswap is measured again instead of read with fields missing
_FORMAT = 3


def cache_key() -> str:
    return (
        f"{cpu_model()} | cpus={os.cpu_count()} threads={torch.get_num_threads()} "
        f"| torch {torch.__version__} | v{_FORMAT}"
    )


def _best_time(fn, budget_s: float = _BUDGET_S, max_reps: int = 20) -> float:
    """Shortest wall time of fn() over repeated runs within budget_s, after a warm-up."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    for _ in range(max_reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure_peak_flops() -> float:
    """Achieved float32 matmul FLOP/s on this machine (best of several runs)."""
    n = _MATMUL_N
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    with torch.no_grad():
        t = _best_time(lambda: torch.mm(a, b, out=c))
    return 2.0 * n**3 / t


def measure_int8_ops() -> float | None:
    """Achieved int8 x int8 -> int32 matmul OP/s (`torch._int_mm`, oneDNN's VNNI/AMX kernels
    where the CPU has them), or None where this build has no CPU int8 matmul."""
    n = _MATMUL_N
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8)
    try:
        with torch.no_grad():
            t = _best_time(lambda: torch._int_mm(a, b), budget_s=_BUDGET_S / 2)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return 2.0 * n**3 / t


def measure_bandwidth() -> float:
    """Achieved main-memory bytes/s: best of a large copy and a large add."""
    numel = _COPY_BYTES // 4
    # Values do not change copy speed; full() is much cheaper to create than rand().
    src = torch.full((numel,), 1.5)
    other = torch.full((numel,), 0.25)
    dst = torch.empty(numel)
    with torch.no_grad():
        t_copy = _best_time(lambda: dst.copy_(src), budget_s=_BUDGET_S / 2)
        t_add = _best_time(lambda: torch.add(src, other, out=dst), budget_s=_BUDGET_S / 2)
    return max(2 * _COPY_BYTES / t_copy, 3 * _COPY_BYTES / t_add)


def measure_dispatch(device="cpu", view: bool = False) -> float:
    """Seconds one tiny op costs on `device` end to end from Python: PyTorch's dispatch
    (and on a GPU the kernel launch), the median over rounds of many one-element adds
    into a fresh tensor; with `view`, of `x.view(-1)`, which dispatches but runs no kernel."""
    import statistics

    dev = torch.device(device)
    a = torch.ones(1, device=dev)
    b = torch.ones(1, device=dev)
    op = (lambda: a.view(-1)) if view else (lambda: torch.add(a, b))
    n = 200
    samples = []
    with torch.inference_mode():
        for _ in range(3):
            op()
        for _ in range(15):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(n):
                op()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def preferred_layout() -> Literal["channels_last", "contiguous"]:
    """channels_last where oneDNN runs the convolutions: its NHWC kernels avoid the
    reorders an NCHW conv pays on every call (measured here, batch 8, layout.channels_last
    alone: zoo:resnet 4.25 -> 3.07 ms, zoo:mobilenet 2.46 -> 1.94 ms). Not measured per
    machine: it follows the library, not the silicon."""
    return "channels_last" if torch.backends.mkldnn.is_available() else "contiguous"


def measure_cpu_target() -> Target:
    """Measure this machine now and describe it as a Target."""
    peak = measure_peak_flops()
    int8 = measure_int8_ops()
    bw = measure_bandwidth()
    dispatch, view = measure_dispatch("cpu"), measure_dispatch("cpu", view=True)
    today = _dt.date.today().isoformat()
    return Target(
        name="cpu",
        description=f"{cpu_model()}, {torch.get_num_threads()} threads",
        kind="cpu",
        peak_flops={"float32": peak, **({"int8": int8} if int8 else {})},
        mem_bandwidth=bw,
        memory_bytes=_memory_bytes(),
        dtypes=("float64", "float32", "bfloat16", "float16", "int8"),
        layout=preferred_layout(),
        preferred_dtype="float32",
        source=(
            f"measured on this machine on {today}: float32 {_MATMUL_N}^3 matmul for peak "
            f"FLOP/s, int8 {_MATMUL_N}^3 torch._int_mm for int8 OP/s, 64 MiB copy/add for bandwidth, one-element adds for the per-op "
            f"dispatch cost (torch {torch.__version__})"
        ),
        dispatch_s=dispatch,
        view_dispatch_s=view,
        notes=(
            "float32 and int8 are measured; other precisions are estimated at the float32 rate.",
        ),
    )


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def get_cpu_target(refresh: bool = False) -> Target:
    """This machine's Target, from the cache when one was measured for the same setup."""
    path = cache_dir() / CACHE_FILE
    key = cache_key()
    data = _read_cache(path)
    entries = data.get("entries", {}) if isinstance(data.get("entries"), dict) else {}
    if not refresh and key in entries:
        try:
            cached = Target.from_dict(entries[key])
            # the layout is a property of the kernels, not a measurement: never stale
            return dataclasses.replace(cached, layout=preferred_layout())
        except (KeyError, TypeError, ValueError):
            pass  # a stale or hand-edited entry: measure again
    target = measure_cpu_target()
    entries[key] = target.to_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"entries": entries}, indent=2))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home is no reason to fail an analysis
    return target
