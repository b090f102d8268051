"""Measuring the gain (chapter 24): interleaved timing, peak memory, per-op profiles."""

from opswap.bench.compare import bench_models
from opswap.bench.memory import MemoryResult, peak_memory
from opswap.bench.profile import OpTime, format_ops, profile_ops
from opswap.bench.stats import BenchResult, ModelBench, Ratio, Stats
from opswap.bench.timing import benchmark

__all__ = [
    "BenchResult",
    "MemoryResult",
    "ModelBench",
    "OpTime",
    "Ratio",
    "Stats",
    "bench_models",
    "benchmark",
    "format_ops",
    "peak_memory",
    "profile_ops",
]
