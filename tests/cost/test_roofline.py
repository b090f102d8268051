"""roofline_point: time, bound and attainable FLOP/s against a target's ceilings."""

from __future__ import annotations

import math

import pytest

from opswap.cost import roofline_point
from opswap.targets import Target

T = Target(
    name="t",
    description="",
    kind="cpu",
    peak_flops={"float32": 1e12, "bfloat16": 4e12},
    mem_bandwidth=1e11,
    memory_bytes=1,
    dtypes=("float32", "bfloat16"),
)  # ridge 10 FLOP/byte in float32, 40 in bfloat16


def test_memory_bound_below_the_ridge():
    p = roofline_point(5_000, 1_000, T, "float32")
    assert p.bound == "memory" and p.ridge == 10 and p.intensity == 5
    assert p.time_s == pytest.approx(1_000 / 1e11)
    assert p.attainable_flops == pytest.approx(5 * 1e11)


def test_compute_bound_above_the_ridge():
    p = roofline_point(30_000, 1_000, T, "float32")
    assert p.bound == "compute"
    assert p.time_s == pytest.approx(30_000 / 1e12)
    assert p.attainable_flops == 1e12


def test_the_ridge_moves_with_dtype():
    p32 = roofline_point(30_000, 1_000, T, "float32")
    p16 = roofline_point(30_000, 1_000, T, "bf16")
    assert (p32.bound, p16.bound) == ("compute", "memory")
    assert p16.ridge == 40 and p16.dtype == "bfloat16"


def test_degenerate_points():
    assert roofline_point(0, 0, T).bound == "none"
    assert roofline_point(0, 0, T).time_s == 0
    p = roofline_point(7, 0, T)
    assert math.isinf(p.intensity) and p.bound == "compute"
    assert roofline_point(0, 64, T).bound == "memory"


def test_named_target():
    p = roofline_point(10**12, 10**9, "a100", "float16")
    assert p.peak_flops == 312e12 and p.bandwidth == 2.039e12
    assert p.bound == "compute"  # 1000 FLOP/byte is far above the A100's ~153
