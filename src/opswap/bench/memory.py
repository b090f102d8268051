"""Peak memory of one call, in bytes above what was allocated before it.

On CUDA the caching allocator keeps exact statistics: reset the peak, call, read
`max_memory_allocated` (tensor bytes, not the larger reserved pool).

On CPU there is no allocator statistic, so the call runs under torch.profiler with
`profile_memory=True`, which records every CPU allocation and free the c10
allocator sees (tensor storage; not Python objects nor memory a library mallocs
by itself, e.g. oneDNN scratchpads). Replaying those events in time order as a
running total gives the peak. The events come from the profiler's event tree; if
a torch version lacks it, the per-op memory columns (allocations attributed to
the innermost op, frees as `[memory]` events) are replayed instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from opswap.bench._quiet import native_stderr_silenced
from opswap.bench.device import resolve_device


@dataclass(frozen=True)
class MemoryResult:
    peak_bytes: int  # highest total allocated during the call, above the level before it
    allocated_bytes: int  # sum of all allocations during the call
    device: str
    method: str  # "cuda-allocator" | "profiler"

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "allocated_bytes": self.allocated_bytes,
            "device": self.device,
            "method": self.method,
        }


def _replay(sizes: list[int]) -> tuple[int, int]:
    total = peak = allocated = 0
    for s in sizes:
        total += s
        peak = max(peak, total)
        if s > 0:
            allocated += s
    return peak, allocated


def _cpu_events_tree(prof) -> list[tuple[int, int]] | None:
    try:
        from torch._C._profiler import _EventType

        roots = prof.profiler.kineto_results.experimental_event_tree()
    except (AttributeError, ImportError, RuntimeError):
        return None
    out: list[tuple[int, int]] = []
    stack = list(roots)
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if str(f.device).startswith("cpu"):
                out.append((e.start_time_ns, int(f.alloc_size)))
        stack.extend(e.children)
    return out


def _cpu_events_flat(prof) -> list[tuple[int, int]]:
    out = []
    for e in prof.events():
        size = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if size:
            out.append((int(e.time_range.start * 1000), int(size)))
    return out


def peak_memory(fn: Callable[[], Any], *, device="cpu") -> MemoryResult:
    """Peak bytes allocated while `fn()` runs, above the level before the call."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        key = "allocated_bytes.all.allocated"  # cumulative bytes handed out
        start_allocs = torch.cuda.memory_stats(dev).get(key, 0)
        out = fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        allocated = torch.cuda.memory_stats(dev).get(key, 0) - start_allocs
        del out
        return MemoryResult(
            int(peak), int(allocated), f"cuda: {torch.cuda.get_device_name(dev)}", "cuda-allocator"
        )

    from torch.profiler import ProfilerActivity, profile

    with (
        native_stderr_silenced(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        out = fn()
    del out
    events = _cpu_events_tree(prof)
    if events is None:
        events = _cpu_events_flat(prof)
    events.sort(key=lambda e: e[0])
    peak, allocated = _replay([s for _, s in events])
    return MemoryResult(peak, allocated, "cpu", "profiler")
