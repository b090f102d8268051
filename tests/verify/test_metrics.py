import json
import math

import pytest
import torch

from opswap.errors import VerificationError
from opswap.verify.metrics import Metrics, combine, compare
from opswap.verify.tolerance import Tolerance


def test_identical_is_perfect():
    x = torch.randn(7, 123)
    m = compare(x, x.clone())
    assert m.max_abs == 0 and m.max_rel == 0 and m.rel_l2 == 0
    assert m.cosine == 1.0
    assert m.sqnr_db == math.inf
    assert m.numel == 7 * 123 and m.nonfinite == 0
    assert m.exact


def test_hand_computed():
    m = compare(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0]))
    assert m.max_abs == pytest.approx(1.0)
    assert m.max_rel == pytest.approx(1 / 3)
    assert m.rel_l2 == pytest.approx(1 / math.sqrt(14))
    assert m.sqnr_db == pytest.approx(10 * math.log10(14))
    assert m.cosine == pytest.approx(17 / math.sqrt(14 * 21))
    assert not m.exact


def test_known_noise_gives_expected_sqnr():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(200_000, generator=g, dtype=torch.float64)
    noise = 0.01 * torch.randn(200_000, generator=g, dtype=torch.float64)  # 40 dB below
    m = compare(ref, ref + noise)
    assert abs(m.sqnr_db - 40.0) < 0.1
    assert m.rel_l2 == pytest.approx(10 ** (-m.sqnr_db / 20), rel=1e-9)
    assert 1 - m.cosine == pytest.approx(m.rel_l2**2 / 2, rel=0.05)


def test_exact_noise_power():
    ref = torch.randn(5, 123, 123)
    noise = torch.randn(5, 123, 123)
    noise *= (ref.double().square().sum() / (noise.double().square().sum() * 1e3)).sqrt().float()
    m = compare(ref, ref + noise)
    assert m.sqnr_db == pytest.approx(30.0, abs=0.01)


def test_scaling():
    ref = torch.randn(1000) + 0.1
    m = compare(ref, 2 * ref)
    assert m.cosine == pytest.approx(1.0, abs=1e-12)  # cosine is blind to scale ...
    assert m.rel_l2 == pytest.approx(1.0, rel=1e-6)  # ... the others are not
    assert m.sqnr_db == pytest.approx(0.0, abs=1e-4)
    assert m.max_rel == pytest.approx(1.0, rel=1e-6)
    assert compare(ref, -ref).cosine == pytest.approx(-1.0)


def test_max_rel_floor_on_tiny_reference():
    ref = torch.randn(1000, dtype=torch.float64)
    ref[0] = 1e-12
    cand = ref.clone()
    cand[0] += 1e-6
    m = compare(ref, cand)
    peak = ref.abs().max().item()
    assert m.max_rel == pytest.approx(1e-6 / (1e-3 * peak), rel=1e-6)  # not 1e6
    zero = torch.zeros(10)
    assert compare(zero, zero + 0.5).max_rel == pytest.approx(0.5)


def test_computed_in_float64():
    ref = torch.full((1000,), 3e20)  # float32 squares overflow to inf
    ref[::2] *= -1
    cand = ref * (1 + 1e-6)
    m = compare(ref, cand)
    rel = ((cand.double() - ref.double()).norm() / ref.double().norm()).item()
    assert math.isfinite(m.sqnr_db) and m.sqnr_db == pytest.approx(-20 * math.log10(rel))
    assert 115 < m.sqnr_db < 125
    half = compare(torch.randn(64, 64), torch.randn(64, 64).half())
    assert math.isfinite(half.rel_l2)


def test_integer_and_bool_outputs():
    ids = torch.randint(0, 50_000, (4, 33))
    assert compare(ids, ids.clone()).exact
    other = ids.clone()
    other[1, 2] += 1
    m = compare(ids, other)
    assert m.max_abs == 1.0 and not m.exact and m.rel_l2 > 0
    b = torch.rand(5, 7) > 0.5
    assert compare(b, b.clone()).exact
    flipped = b.clone()
    flipped[0, 0] = ~flipped[0, 0]
    assert compare(b, flipped).max_abs == 1.0


def test_nan_and_inf_detection():
    ref = torch.randn(100)
    cand = ref.clone()
    cand[[3, 50, 70]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    m = compare(ref, cand)
    assert m.nonfinite == 3
    assert m.max_abs == 0.0  # the finite part is intact; the count tells the story
    ok, reasons = Tolerance.for_exactness("lossy").check(m)
    assert not ok and "NaN/Inf" in reasons[0]
    # a non-finite value the reference has too is not a defect
    ref2 = ref.clone()
    ref2[5] = float("inf")
    ref2[6] = float("nan")
    assert compare(ref2, ref2.clone()).nonfinite == 0
    cand2 = ref2.clone()
    cand2[5] = 1.0
    assert compare(ref2, cand2).nonfinite == 1


def test_shape_mismatch_raises():
    with pytest.raises(VerificationError, match="shape"):
        compare(torch.randn(3, 4), torch.randn(4, 3))


def test_combine_is_worst_case_and_json():
    a = compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1]))
    b = compare(torch.tensor([5.0, -1.0]), torch.tensor([5.5, -1.0]))
    c = combine([a, b])
    assert c.max_abs == max(a.max_abs, b.max_abs)
    assert c.cosine == min(a.cosine, b.cosine)
    assert c.sqnr_db == min(a.sqnr_db, b.sqnr_db)
    assert c.rel_l2 == max(a.rel_l2, b.rel_l2)
    assert c.numel == 4
    assert combine([]) == Metrics()
    data = json.loads(json.dumps(c.to_json()))
    assert {"max_abs", "max_rel", "cosine", "sqnr_db", "rel_l2", "numel", "nonfinite"} <= set(data)
    assert json.loads(json.dumps(Metrics().to_json()))["sqnr_db"] == math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_differences_below_the_dtypes_resolution_at_the_outputs_scale_count_as_zero(dtype):
    # an output of near-zero elements (denormals in float32) that an exact rewrite changed
    # by a few units of the last denormal place: the relative measures must not call the
    # rounding of nothing a changed function (an exact BatchNorm fold was rolled back on
    # hf:mobilevit with cosine 0.95 at max_abs 2.8e-45)
    fi = torch.finfo(dtype)
    g = torch.Generator().manual_seed(3)
    denormal = fi.tiny * fi.eps  # the smallest positive value of the dtype
    ref = (torch.randn(4, 25, generator=g, dtype=torch.float64) * 8 * denormal).to(dtype)
    cand = ref.clone()
    cand.view(-1)[::7] += torch.tensor(2 * denormal, dtype=dtype)
    m = compare(ref, cand)
    assert 0 < m.max_abs < fi.tiny  # the difference is reported as it is ...
    assert (m.cosine, m.sqnr_db, m.rel_l2, m.max_rel) == (1.0, math.inf, 0.0, 0.0)  # ... but is 0
    assert Tolerance.for_exactness("exact").check(m)[0]
    # at a normal scale, one unit in the last place of the peak is the floor, and a
    # difference of a few hundred ulp of the peak still counts
    big = torch.randn(3, 41, generator=g).to(dtype)
    peak = float(big.abs().max())
    bumped = big.clone()
    bumped.view(-1)[5] += 300 * fi.eps * peak
    m2 = compare(big, bumped)
    assert m2.rel_l2 > 0 and m2.cosine < 1.0 and math.isfinite(m2.sqnr_db)
    tiny_bump = big.double().clone()
    tiny_bump.view(-1)[5] += 0.5 * fi.eps * peak  # below the dtype's resolution at the peak
    assert compare(big, tiny_bump).rel_l2 == 0.0


def test_the_floor_does_not_hide_a_real_change_of_a_small_output():
    ref = torch.randn(1000) * 1e-30  # tiny but normal: float32 resolves it
    m = compare(ref, ref * 1.01)
    assert m.rel_l2 == pytest.approx(0.01, rel=1e-3)
    assert not Tolerance.for_exactness("exact").check(m)[0]
    ints = torch.randint(0, 9, (50,))
    other = ints.clone()
    other[0] += 1
    assert compare(ints, other).rel_l2 > 0  # integers have no floor


def test_differences_within_the_resolution_read_the_same_in_max_abs_sqnr_and_rel_l2():
    # `verify --backend ort --layers` showed `max_abs 4.77e-07` beside `sqnr inf` and
    # `rel_l2 0`: a difference of one unit in the last place at the value's scale, which
    # the floor counts as none. Displays must say so in SQNR and rel_l2 alike.
    from opswap.verify.layers import LayerReport, LayerRow
    from opswap.verify.metrics import RESOLUTION, RESOLUTION_NOTE, shown, within_resolution

    g = torch.Generator().manual_seed(5)
    ref = torch.randn(3, 17, 9, generator=g) * 3
    ulp = ref.clone()
    i = int(ref.abs().argmax())
    ulp.view(-1)[i] = torch.nextafter(ref.view(-1)[i], torch.tensor(math.inf))
    off = ref.clone()
    off.view(-1)[4] += 1e-3
    same, rounding, real = compare(ref, ref), compare(ref, ulp), compare(ref, off)
    assert rounding.max_abs > 0 and (rounding.sqnr_db, rounding.rel_l2) == (math.inf, 0.0)
    assert [within_resolution(m) for m in (same, rounding, real)] == [False, True, False]
    assert within_resolution(rounding.to_json()) and within_resolution(combine([same, rounding]))
    assert not within_resolution(combine([rounding, real]))
    for m in (rounding, rounding.to_json()):
        assert shown(m, "sqnr_db", ".1f") == shown(m, "rel_l2", ".3g") == RESOLUTION
        assert shown(m, "max_abs", ".3g") == f"{rounding.max_abs:.3g}"
    assert (shown(same, "sqnr_db", ".1f"), shown(same, "rel_l2", ".3g")) == ("inf", "0")
    assert shown(real, "sqnr_db", ".1f") == f"{real.sqnr_db:.1f}"

    rows = [
        LayerRow(name, "", "add", m, name, "name")
        for name, m in (("same", same), ("rounding", rounding), ("real", real))
    ]
    table = LayerReport(rows).table().splitlines()
    line = next(t for t in table if t.split()[:2] == ["1", "rounding"])
    assert line.split()[-2:] == [RESOLUTION, RESOLUTION] and "inf" not in line
    assert RESOLUTION_NOTE in table
    assert RESOLUTION_NOTE not in LayerReport([rows[0], rows[2]]).table()
