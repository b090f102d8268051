import pytest
import torch

from opswap.errors import VerificationError
from opswap.verify.metrics import compare
from opswap.verify.tolerance import Tolerance, as_tolerance, parse_budget, tolerance_for


def test_defaults_are_ordered():
    e, a, lo = (Tolerance.for_exactness(x) for x in ("exact", "approx", "lossy"))
    assert e.cosine_min > a.cosine_min > lo.cosine_min
    assert e.rel_l2_max < a.rel_l2_max < lo.rel_l2_max
    assert e.sqnr_min_db > a.sqnr_min_db > lo.sqnr_min_db
    with pytest.raises(VerificationError, match="exact, approx or lossy"):
        Tolerance.for_exactness("roughly")


def _matmul_in(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(67, 301, generator=g, dtype=torch.float64)
    b = torch.randn(301, 45, generator=g, dtype=torch.float64)
    return a @ b, (a.to(dtype) @ b.to(dtype))


def test_float32_rounding_passes_exact_and_half_does_not():
    ref, f32 = _matmul_in(torch.float32)
    assert Tolerance.for_exactness("exact").check(compare(ref, f32))[0]
    ref, bf16 = _matmul_in(torch.bfloat16)
    m = compare(ref, bf16)
    assert not Tolerance.for_exactness("exact").check(m)[0]
    assert Tolerance.for_exactness("approx").check(m)[0]


def test_changed_function_fails_exact():
    ref = torch.randn(5, 123, 123)
    m = compare(ref, ref * 1.001)
    ok, reasons = Tolerance.for_exactness("exact").check(m)
    assert not ok
    assert any("rel_l2" in r and "above" in r for r in reasons)
    assert Tolerance.for_exactness("approx").check(m) == (True, [])


def test_parse_budget_forms():
    t = parse_budget("cosine>=0.9999")
    assert t == Tolerance(cosine_min=0.9999)
    t = parse_budget(" sqnr_db >= 40 , rel_l2<=1e-3,max_abs<=1e-4 ")
    assert (t.sqnr_min_db, t.rel_l2_max, t.max_abs, t.cosine_min) == (40.0, 1e-3, 1e-4, None)
    assert parse_budget("SQNR=>35").sqnr_min_db == 35.0
    assert parse_budget("max_rel<=0.01").max_rel == 0.01


def test_parse_budget_overrides_base():
    base = Tolerance.for_exactness("approx")
    t = parse_budget("cosine>=0.9999", base=base)
    assert t.cosine_min == 0.9999 and t.rel_l2_max == base.rel_l2_max
    assert base.with_budget("max_abs<=0.5").max_abs == 0.5


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "cosine",
        "cosine<=0.9",
        "rel_l2>=1e-3",
        "accuracy>=0.9",
        "cosine>=high",
        "cosine>=2",
        "max_abs<=-1",
        "cosine>=0.9,,x",
        "cosine 0.9",
    ],
)
def test_bad_budget_is_one_clear_error(bad):
    with pytest.raises(VerificationError) as info:
        parse_budget(bad)
    msg = str(info.value)
    assert "METRIC>=X" in msg and "\n" not in msg


def test_check_reasons_in_words():
    m = compare(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.5]))
    ok, reasons = Tolerance(cosine_min=0.9999, max_abs=0.1, sqnr_min_db=40).check(m)
    assert not ok and len(reasons) == 3
    assert any(r.startswith("cosine") and "below 0.9999" in r for r in reasons)
    assert any(r.startswith("max_abs 0.5 is above 0.1") for r in reasons)
    assert Tolerance().check(m) == (True, [])  # no thresholds: nothing to break


def test_as_tolerance_and_str():
    assert as_tolerance(None) == Tolerance.for_exactness("exact")
    assert as_tolerance("lossy") == Tolerance.for_exactness("lossy")
    assert as_tolerance("cosine>=0.5") == Tolerance(cosine_min=0.5)
    t = Tolerance.for_exactness("approx")
    assert parse_budget(str(t)) == t
    assert t.to_json()["cosine_min"] == 0.999


def test_tolerance_for_loosens_to_the_rounding_and_puts_the_budget_on_top():
    assert tolerance_for("approx") == Tolerance.for_exactness("approx")
    loose = tolerance_for("exact", rounding=1e-3)  # a bfloat16 model's own rounding
    assert loose == Tolerance.for_exactness("exact").at_rounding(1e-3)
    assert loose.rel_l2_max == pytest.approx(4e-3)
    # the budget's thresholds are the user's: the rounding never loosens them
    strict = tolerance_for("exact", "rel_l2<=1e-6", rounding=1e-3)
    assert strict.rel_l2_max == 1e-6 and strict.cosine_min == loose.cosine_min
    with pytest.raises(VerificationError, match="Unknown exactness"):
        tolerance_for("loose")
    with pytest.raises(VerificationError, match="Cannot read the budget term"):
        tolerance_for("exact", "cosine")
