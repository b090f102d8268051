"""opswap.graph.observers: scales and zero points that hold 0 exactly, what each
calibration method picks on distributions whose answer is known, and non-finite values
left out of the ranges."""

from __future__ import annotations

import math

import pytest
import torch

from opswap.graph.observers import METHODS, Observer, qparams


def test_qparams_hold_zero_exactly():
    for lo, hi, sym in [(-1.0, 3.0, False), (0.5, 2.0, False), (-4.0, -1.0, False), (-2, 5, True)]:
        p = qparams(lo, hi, sym)
        assert 0 <= p.zero_point <= 255
        q0 = round(0.0 / p.scale) + p.zero_point
        assert (q0 - p.zero_point) * p.scale == 0.0
        if sym:
            assert p.zero_point == 128 and math.isclose(p.scale, 5 / 127)
    with pytest.raises(ValueError, match="not finite"):
        qparams(-math.inf, 1.0, False)


def _observe(chunks):
    o = Observer()
    for c in chunks:
        o.observe_range(c)
    for c in chunks:
        o.observe_values(c)
    return o


def test_methods_on_known_distributions():
    g = torch.Generator().manual_seed(0)
    bulk = [torch.randn(4096, generator=g) for _ in range(4)]
    outlier = torch.tensor([60.0])
    o = _observe([*bulk, outlier])
    assert o.choose("minmax", False)[1] == 60.0
    assert o.choose("minmax", True) == (-60.0, 60.0)
    # 1 value in 16385 is above the 99.99th percentile's cut: clipped
    lo, hi = o.choose("percentile", False, percentile=99.99)
    assert hi < 10 and lo < -2
    # MSE and entropy cut the range somewhere inside it
    for m in ("mse", "entropy"):
        lo, hi = o.choose(m, True)
        assert 0 < hi <= 60.0 and lo == -hi
    # with no outliers percentile keeps nearly the whole range
    u = _observe([torch.rand(10000, generator=g) for _ in range(2)])
    assert u.choose("percentile", False)[1] > 0.99
    # MSE's range quantises the heavy-tailed data with less error than min-max's
    data = torch.cat([*bulk, outlier])

    def mse(p):
        q = torch.clamp(torch.round(data / p.scale) + p.zero_point, 0, 255)
        return float(((q - p.zero_point) * p.scale - data).pow(2).mean())

    assert mse(o.qparams("mse", True)) <= mse(o.qparams("minmax", True))
    with pytest.raises(ValueError, match="unknown calibration method"):
        o.choose("median", False)
    assert set(METHODS) == {"minmax", "percentile", "mse", "entropy"}


def test_observer_leaves_nonfinite_values_out():
    o = _observe([torch.tensor([1.0, -2.0, math.inf, math.nan])])
    assert (o.lo, o.hi) == (-2.0, 1.0) and o.nonfinite == 2
    with pytest.raises(ValueError, match="saw no finite value"):
        Observer().choose("minmax", False)
