import math

import pytest
import torch

from opswap.errors import VerificationError
from opswap.verify.metrics import Metrics, compare
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


def test_class_score_budgets_parse_and_print():
    t = parse_budget("top1>=0.995, top5>=0.999 ,centred_rel_l2<=0.01")
    assert (t.top1_min, t.top5_min, t.centred_rel_l2_max) == (0.995, 0.999, 0.01)
    assert parse_budget("centered_rel_l2<=0.02").centred_rel_l2_max == 0.02
    assert parse_budget("centred_rel_l2<=inf").centred_limit() == math.inf
    assert parse_budget(str(t)) == t
    assert "top1>=0.99" in str(Tolerance.for_exactness("approx"))
    for bad in ("top1>=1.5", "top1<=0.9", "top5>=-0.1", "centred_rel_l2>=0.1"):
        with pytest.raises(VerificationError, match="METRIC>=X"):
            parse_budget(bad)


def test_class_score_defaults_follow_exactness():
    e, a, lo = (Tolerance.for_exactness(x) for x in ("exact", "approx", "lossy"))
    assert e.top1_min == 1.0 and a.top1_min == 0.99 and lo.top1_min == 0.95
    assert a.top5_min > a.top1_min  # leaving the top 5 is a larger move than a swap at the top
    # the centred bound is the plain one (or SQNR's, if stricter) unless the budget sets it
    assert a.centred_limit() == a.rel_l2_max
    assert parse_budget("sqnr_db>=60").centred_limit() == pytest.approx(1e-3)
    assert Tolerance().centred_limit() is None
    # rows: none extra at exact, ~1000 at a 1% budget, more for a tighter one, at most 4096
    assert e.decision_rows() == 0 and a.decision_rows() == 1000 and lo.decision_rows() == 1000
    assert a.with_budget("top1>=0.998").decision_rows() == 4096
    assert a.with_budget("top1>=0").decision_rows() == 0
    assert a.decision_rows(settle=True) == 4096
    # an exact rewrite of a low-precision model may swap what its own rounding cannot order
    assert e.at_rounding(1e-3).rounding_rel == pytest.approx(4e-3)


def test_agreement_and_centred_reasons_in_one_sentence():
    from opswap.verify.decisions import Agreement

    a = Tolerance.for_exactness("approx")
    assert a.check_agreement(Agreement(1, 4096, 344)) == [
        "top-1 class changed on 8.4% of 4096 rows (budget 1%)"
    ]
    assert a.check_agreement(Agreement(1, 1000, 10)) == []
    assert a.check_agreement(Agreement(5, 1000, 5)) == [
        "top-1 class left the top 5 on 0.5% of 1000 rows (budget 0.2%)"
    ]
    e = Tolerance.for_exactness("exact")
    assert "none beyond rounding ties" in e.check_agreement(Agreement(1, 24, 1))[0]
    # 1.2% of 1000 rows cannot be told from 1%; 3% can, and so can 0.2%
    assert a.unsettled(Agreement(1, 1000, 12))
    assert not a.unsettled(Agreement(1, 1000, 30)) and not a.unsettled(Agreement(1, 1000, 2))
    assert not a.unsettled(Agreement(5, 1000, 2))  # only the top-1 rate is settled
    # none changed on 300 rows: a 1% rate would have shown one with 95% probability
    assert a.decided(Agreement(1, 300, 0)) and not a.decided(Agreement(1, 299, 0))
    assert not a.decided(Agreement(1, 300, 1))
    assert a.decided(Agreement(1, 100, 41))  # fails at 4096 rows whatever comes
    assert not e.decided(Agreement(1, 10_000, 0))  # exact judges the samples as they are
    plain = compare(torch.full((4, 8), -2.0), torch.full((4, 8), -2.0) + 1e-4)
    centred = Metrics(rel_l2=0.049, numel=32)
    (why,) = a.check_centred(centred, plain, offset=25.0)
    assert why.startswith("centred per row, rel_l2 0.049 is above 0.03")
    # an error the exact level calls rounding is not a centred failure: 1e-5 x the offset
    assert e.check_centred(Metrics(rel_l2=1e-3, numel=32), plain, offset=500.0) == []
    assert e.check_centred(Metrics(rel_l2=1e-2, numel=32), plain, offset=500.0) != []
