"""The roofline: an op's time is bounded by its FLOPs at peak rate and its bytes at full bandwidth.

    time = max(flops / peak_flops[dtype], bytes / mem_bandwidth)

An op whose arithmetic intensity (FLOP/byte) is above the target's ridge point
(peak / bandwidth) is compute-bound; below it, memory-bound. The estimate has no
launch overheads and assumes perfect overlap of compute and memory traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opswap.targets import Target, dtype_key, get_target


@dataclass(frozen=True)
class RooflinePoint:
    flops: int
    bytes: int
    dtype: str
    intensity: float  # FLOP per byte (inf when bytes == 0 < flops)
    ridge: float  # the target's ridge point for dtype, FLOP per byte
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    attainable_flops: float  # min(peak, intensity * bandwidth), FLOP/s
    time_s: float
    bound: str  # 'compute', 'memory', or 'none' for an op that costs nothing


def roofline_point(
    flops: int, bytes: int, target: Target | str, dtype: torch.dtype | str = "float32"
) -> RooflinePoint:
    """Where an op with `flops` and `bytes` sits on `target`'s roofline for `dtype`."""
    t = get_target(target)
    peak = t.peak(dtype)
    bw = t.mem_bandwidth
    if bytes > 0:
        intensity = flops / bytes
    else:
        intensity = float("inf") if flops else 0.0
    compute_s = flops / peak
    memory_s = bytes / bw
    if flops == 0 and bytes == 0:
        bound = "none"
    else:
        bound = "compute" if compute_s >= memory_s else "memory"
    attainable = peak if intensity == float("inf") else min(peak, intensity * bw)
    return RooflinePoint(
        flops=int(flops),
        bytes=int(bytes),
        dtype=dtype_key(dtype),
        intensity=intensity,
        ridge=peak / bw,
        peak_flops=peak,
        bandwidth=bw,
        attainable_flops=attainable,
        time_s=max(compute_s, memory_s),
        bound=bound,
    )
