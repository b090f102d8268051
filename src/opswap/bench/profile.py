"""Where the time goes, op by op (chapter 24): torch.profiler's self time per operator.

"Self" time excludes the ops an op calls (aten::linear's self time leaves out the
aten::addmm inside it), so self times add up to the total and the largest ones
name the operators worth replacing. On CUDA the ranking uses device (kernel)
time, since CPU-side time there is mostly launch overhead.

The profiled calls come after `warmup` unprofiled ones, and every figure is per
call of `fn` (divided by `repeats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from opswap.bench._quiet import native_stderr_silenced
from opswap.bench.device import resolve_device

_SKIP = ("ProfilerStep", "[memory]", "[OutOfMemory]", "Activity Buffer Request")  # profiler's own


@dataclass(frozen=True)
class OpTime:
    """One operator's share of a call of the profiled function (times in ms per call)."""

    name: str
    calls: float  # per call of fn
    self_ms: float  # device self time on CUDA, CPU self time otherwise
    cpu_self_ms: float
    cpu_total_ms: float
    device_self_ms: float
    share: float  # of the summed self time, 0..1
    shapes: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _device_self_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def profile_ops(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 5,
    device="cpu",
    record_shapes: bool = False,
    chrome_trace: str | Path | None = None,
    kernels: bool = False,
) -> list[OpTime]:
    """Per-operator self time of `fn()`, largest first.

    `record_shapes` splits each operator by input shapes. `chrome_trace`, if given,
    is a path where the trace is written for chrome://tracing or Perfetto. On CUDA,
    an operator's device time is that of the kernels it launched; `kernels=True`
    lists the kernels themselves instead (their time would otherwise count twice).
    """
    from torch.profiler import ProfilerActivity, profile

    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        fn()
    sync()
    with (
        native_stderr_silenced(),
        profile(activities=activities, record_shapes=record_shapes) as prof,
    ):
        for _ in range(repeats):
            fn()
        sync()
    if chrome_trace is not None:
        path = Path(chrome_trace)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))

    rows = []
    for evt in prof.key_averages(group_by_input_shape=record_shapes):
        if evt.key.startswith(_SKIP):
            continue
        if cuda and (getattr(evt, "device_type", DeviceType.CPU) != DeviceType.CPU) != kernels:
            continue
        dev_us = _device_self_us(evt) if cuda else 0.0
        cpu_us = float(evt.self_cpu_time_total)
        rows.append((evt, dev_us if cuda else cpu_us, cpu_us, dev_us))
    total = sum(r[1] for r in rows) or 1.0
    ops = [
        OpTime(
            name=evt.key,
            calls=evt.count / repeats,
            self_ms=main / repeats / 1e3,
            cpu_self_ms=cpu_us / repeats / 1e3,
            cpu_total_ms=float(evt.cpu_time_total) / repeats / 1e3,
            device_self_ms=dev_us / repeats / 1e3,
            share=main / total,
            shapes=str(evt.input_shapes) if record_shapes else "",
        )
        for evt, main, cpu_us, dev_us in rows
    ]
    ops.sort(key=lambda o: o.self_ms, reverse=True)
    return ops


def format_ops(ops: list[OpTime], limit: int = 15) -> str:
    """A plain-text table of the top `limit` operators."""
    head = f"{'op':<40} {'calls':>6} {'self ms':>9} {'share':>6}"
    lines = [head, "-" * len(head)]
    for o in ops[:limit]:
        lines.append(f"{o.name[:40]:<40} {o.calls:>6.1f} {o.self_ms:>9.3f} {o.share:>6.1%}")
    if len(ops) > limit:
        rest = sum(o.share for o in ops[limit:])
        lines.append(f"{f'({len(ops) - limit} more)':<40} {'':>6} {'':>9} {rest:>6.1%}")
    return "\n".join(lines)
