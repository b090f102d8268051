"""The Target dataclass: one piece of hardware described by its ceilings.

A roofline model needs two numbers per precision: how many FLOP/s the chip can
do and how many bytes/s its memory can feed. Their ratio, the ridge point, says
how many FLOPs an op must do per byte it moves before compute, not memory,
limits it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch

# Canonical precision names used as keys of Target.peak_flops.
DTYPE_KEYS = ("float64", "float32", "tf32", "bfloat16", "float16", "float8", "int8")

_ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "float8_e4m3fnuz": "float8",
    "float8_e5m2fnuz": "float8",
    "uint8": "int8",
    "qint8": "int8",
    "quint8": "int8",
}


def dtype_key(dtype: torch.dtype | str) -> str:
    """Canonical key for a torch dtype or a spelling of one ('fp16', 'torch.bfloat16', ...).

    Integer and boolean dtypes other than 8-bit map to 'float32': index arithmetic
    does not run on tensor cores, and no datasheet quotes a rate for it.
    """
    name = str(dtype).removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    if name in DTYPE_KEYS:
        return name
    return "float32"


#: times functions side by side on this machine: {name: fn} -> {name: fastest seconds per call}
Timer = Callable[[dict[str, Callable[[], object]]], dict[str, float]]


@dataclass(frozen=True)
class Target:
    """A hardware profile: peak FLOP/s per precision, memory bandwidth and preferences."""

    name: str
    description: str
    kind: Literal["cpu", "cuda", "npu", "mobile"] | str
    peak_flops: Mapping[str, float]  # FLOP/s (or OP/s for int8) per dtype_key, dense
    mem_bandwidth: float  # bytes/s, main memory (HBM, DRAM)
    memory_bytes: int
    dtypes: tuple[str, ...]
    layout: Literal["channels_last", "contiguous"] = "contiguous"
    preferred_dtype: str = "float32"
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # seconds each op costs before it moves a byte: eager dispatch on a CPU, dispatch plus
    # kernel launch on a GPU. The roofline cannot see it; on small models it dominates.
    dispatch_s: float = 0.0
    # the same for an op that moves no data (a view, an alias): dispatch, no kernel
    view_dispatch_s: float = 0.0
    # for rules that measure a site on this machine rather than estimate it: a CPU target's
    # timer runs on this machine's CPU (bench.timing.with_timer sets it; None: estimate only)
    timer: Timer | None = field(default=None, repr=False, compare=False)

    def op_overhead(self, moves_data: bool) -> float:
        """The fixed cost of one op: a kernel's dispatch (and launch), or a view's."""
        return self.dispatch_s if moves_data else self.view_dispatch_s

    def peak(self, dtype: torch.dtype | str = "float32") -> float:
        """Peak FLOP/s for `dtype`; a precision without a figure falls back to float32's."""
        key = dtype_key(dtype)
        if key in self.peak_flops:
            return float(self.peak_flops[key])
        return float(self.peak_flops["float32"])

    def ridge_point(self, dtype: torch.dtype | str = "float32") -> float:
        """FLOP per byte above which an op is compute-bound on this target."""
        return self.peak(dtype) / self.mem_bandwidth

    def supports(self, dtype: torch.dtype | str) -> bool:
        return dtype_key(dtype) in self.dtypes

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["timer"]
        d["peak_flops"] = dict(self.peak_flops)
        d["dtypes"] = list(self.dtypes)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> Target:
        return cls(
            name=d["name"],
            description=d["description"],
            kind=d["kind"],
            peak_flops={str(k): float(v) for k, v in d["peak_flops"].items()},
            mem_bandwidth=float(d["mem_bandwidth"]),
            memory_bytes=int(d["memory_bytes"]),
            dtypes=tuple(d["dtypes"]),
            layout=d.get("layout", "contiguous"),
            preferred_dtype=d.get("preferred_dtype", "float32"),
            source=d.get("source", ""),
            notes=tuple(d.get("notes", ())),
            dispatch_s=float(d.get("dispatch_s", 0.0)),
            view_dispatch_s=float(d.get("view_dispatch_s", 0.0)),
        )

    def __str__(self) -> str:
        return self.name
