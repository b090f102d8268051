"""The variants race: baselines in the same run, only verified variants may win, and the
input wins unless something beats it beyond the run's noise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.bench.variants import VariantTiming, best, build, parse_compare, race
from opswap.config import OptimizeConfig
from opswap.errors import OpswapError
from opswap.pipeline import optimize


def _t(name, ms, lo, hi, verified=True):
    # lo, hi: the bootstrap interval of the speed-up (the quartiles are not what decides)
    return VariantTiming(
        name,
        ms,
        0.01,
        1.0 / ms if ms else None,
        lo - 0.1,
        hi + 0.1,
        verified,
        ci_low=lo,
        ci_high=hi,
    )


def test_parse_compare():
    assert parse_compare(None) == ["compile"]
    assert parse_compare("none") == [] and parse_compare("") == []
    assert parse_compare("compile,compile") == ["compile"]
    with pytest.raises(OpswapError, match="Unknown baseline 'onnx'"):
        parse_compare("onnx")


def test_best_is_the_input_unless_beaten_beyond_noise():
    inp = _t("input", 1.0, 1.0, 1.0)
    assert best([inp, _t("opswap", 0.9, 0.95, 1.2)]).name == "input"  # within noise
    assert best([inp, _t("opswap", 1.2, 0.7, 0.9)]).name == "input"  # slower
    assert (
        best([inp, _t("opswap", 0.8, 1.1, 1.3), _t("opswap+compile", 0.5, 1.8, 2.2)]).name
        == "opswap+compile"
    )
    # an unverified variant never wins, however fast
    assert best([inp, _t("opswap", 0.1, 9, 11, verified=False)]).name == "input"


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_race_times_only_verified_variants():
    m = Small().eval()
    x = (torch.randn(4, 16),)
    vs = build(m, m, m, x, [], torch.device("cpu"))
    assert [v.name for v in vs] == ["input", "captured", "opswap"]
    vs[1].verified, vs[2].verified = True, False
    timings, res = race(vs, x, torch.device("cpu"), min_time_s=0.05)
    out = {t.name: t for t in timings}
    assert set(res.stats) == {"input", "captured"}
    assert out["input"].speedup_vs_input == 1.0 and out["captured"].ms > 0
    assert out["opswap"].ms is None and not out["opswap"].verified


def test_optimize_races_torch_compile_and_records_the_winner(tmp_path):
    m = Small().eval()
    r = optimize(
        m, (torch.randn(4, 16),), OptimizeConfig(samples=1, layers=False, measure_rules=False)
    )
    names = [v.name for v in r.variants]
    assert names == ["input", "captured", "opswap", "compile", "opswap+compile"]
    timed = {v.name: v for v in r.variants}
    assert timed["compile"].compile_s is not None and timed["compile"].verified
    assert r.best in names and r.to_json()["best"] == r.best
    # the printed ratio is the ratio of the printed medians
    for v in r.variants:
        if v.ms is not None:
            assert v.speedup_vs_input == pytest.approx(timed["input"].ms / v.ms)
    deploy = r.to_json()["deploy"]
    assert deploy["variant"] == r.best and deploy["compile"] == r.best.endswith("compile")
    r.save(tmp_path)
    assert (tmp_path / "model.pt2").exists()


def test_when_nothing_beats_the_input_the_input_is_saved(tmp_path):
    m = Small().eval()
    r = optimize(
        m,
        (torch.randn(4, 16),),
        OptimizeConfig(samples=1, layers=False, measure_rules=False, compare="none"),
    )
    r.best = "input"  # what `best` returns when nothing is faster beyond noise
    art = r.saved_artifact
    assert art is r.artifacts["input"] and r.saved_module is art.module  # the file timed
    assert "unchanged" in r.deploy()["holds"]
    r.save(tmp_path)
    assert (tmp_path / "model.pt2").read_bytes() == art.path.read_bytes()
    # where the export of the input ran slower than the module, the advice is to keep the module
    import dataclasses

    r.variants = [
        dataclasses.replace(v, speedup_vs_input=0.9, ci_low=0.85, ci_high=0.95)
        if v.name == "captured"
        else v
        for v in r.variants
    ]
    d = r.deploy()
    assert "0.90x" in d["holds"] and d["how"].startswith("your own module")


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.conv2(torch.relu(self.bn(self.conv(x))))


def test_the_saved_file_is_the_one_timed_and_keeps_the_fused_kernel(tmp_path):
    import opswap

    torch.manual_seed(0)
    m = ConvNet().eval()
    x = torch.randn(2, 3, 12, 12)
    r = optimize(
        m, (x,), OptimizeConfig(samples=1, layers=False, measure_rules=False, compare="none")
    )
    assert any(s.rule == "fusion.conv_relu" for s in r.applied)
    timed = {v.name: v for v in r.variants}
    assert "reloaded from model.pt2" in timed["opswap"].note
    art = r.artifacts["candidate"]
    ops = [n.target for n in art.module.graph.nodes if n.op == "call_function"]
    assert torch.ops.opswap.conv_relu.default in ops  # export kept the fused op
    r.best = "opswap"
    r.save(tmp_path)
    assert (tmp_path / "model.pt2").read_bytes() == art.path.read_bytes()
    loaded = opswap.load_optimized(tmp_path)
    other = torch.randn(5, 3, 12, 12)  # another batch: the file is dynamic in batch
    with torch.inference_mode():
        torch.testing.assert_close(loaded(other), m(other), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="must be a 4-D torch.float32 tensor"):
        loaded(torch.randn(3, 12, 12))


def _u(name, ms, lo, hi):
    # a timing whose interval did not narrow before the race's time ran out
    return VariantTiming(
        name, ms, 0.01, 1.0 / ms, lo, hi, True, ci_low=lo, ci_high=hi, settled=False
    )


def test_on_a_busy_machine_the_choice_is_conservative():
    inp = _t("input", 1.0, 1.0, 1.0)
    # a lower end just above 1 on an interval that holds anything is not a speed-up
    assert best([inp, _u("opswap", 0.07, 1.02, 38.4)]).name == "input"
    # the highest lower end wins, not the lowest median
    assert (
        best([inp, _u("opswap", 0.07, 1.07, 38.4), _u("compile", 0.2, 1.3, 9.0)]).name == "compile"
    )
    # settled and clear of 1 by any amount: the fastest median, as before
    assert best([inp, _t("opswap", 0.9, 1.01, 1.09)]).name == "opswap"


def test_a_busy_race_says_it_did_not_settle(monkeypatch):
    from opswap.bench import timing
    from opswap.bench.noisy import busy

    monkeypatch.setattr(timing, "_Timer", busy(seed=3))
    m = Small().eval()
    x = (torch.randn(4, 16),)
    vs = build(m, m, m, x, [], torch.device("cpu"))
    for v in vs:
        v.verified = True
    timings, res = race(vs, x, torch.device("cpu"))
    by = {t.name: t for t in timings}
    assert res.settled is False
    assert by["captured"].settled is False and by["opswap"].settled is False
    assert by["opswap"].to_json()["settled"] is False


def _faked_race(**speedups):
    """bench.variants.race as run, then the named variants given these speed-ups over the
    input (settled intervals of +-10%), so that the test decides who is fastest while the
    verification is real."""
    import dataclasses

    from opswap.bench import variants

    real = variants.race

    def fake(vs, inputs, device, **kw):
        timings, res = real(vs, inputs, device, **kw)
        base = next(t for t in timings if t.name == "input").ms
        return [
            dataclasses.replace(t, ms=base / s, speedup_vs_input=s, ci_low=0.9 * s, ci_high=1.1 * s)
            if (s := speedups.get(t.name.replace("+", "_"))) and t.ms is not None
            else t
            for t in timings
        ], res

    return fake


def _captured_fails(monkeypatch, at: str = "every size"):
    """The race's `captured` variant (the plain export of the input, the file `input` and
    `compile` save) fails its verification, as if that file were wrong: at every size (its
    static re-export too), or only at sizes other than the example's ("other sizes", as a
    bf16 convolution stack on a GPU whose algorithms change with the batch)."""
    import dataclasses

    from opswap.bench import variants
    from opswap.verify import outputs

    build, verify, fallback = variants.build, outputs.verify, variants._static_fallback

    def tagged(*args, **kwargs):
        vs = build(*args, **kwargs)
        for v in vs:
            if v.name == "captured":
                v.fn._injected_wrong = True
        return vs

    def check(model, fn, *args, **kwargs):
        out = verify(model, fn, *args, **kwargs)
        wrong = getattr(fn, "_injected_wrong", False)
        if wrong and (at == "every size" or kwargs.get("variants")):
            return dataclasses.replace(out, passed=False, reasons=["injected: wrong output"])
        return out

    def static_fails_too(v, *args, **kwargs):
        if v.name == "captured":
            v.reasons.append("exported with static sizes, it fails too: injected")
            return None
        return fallback(v, *args, **kwargs)

    monkeypatch.setattr(variants, "build", tagged)
    monkeypatch.setattr(outputs, "verify", check)
    if at == "every size":
        monkeypatch.setattr(variants, "_static_fallback", static_fails_too)


def test_a_compiled_winner_saves_a_file_verified_at_every_claimed_shape(monkeypatch, tmp_path):
    import opswap
    from opswap.bench import variants

    torch.manual_seed(0)
    m = ConvNet().eval()
    x = torch.randn(2, 3, 12, 12)
    config = OptimizeConfig(samples=1, layers=False, measure_rules=False)
    monkeypatch.setattr(variants, "race", _faked_race(compile=10.0, opswap=2.0))
    # the export compile would save failed its verification: compile may not win as that file
    _captured_fails(monkeypatch)
    r = optimize(m, (x,), config)
    assert not {v.name: v for v in r.variants}["captured"].verified
    assert r.best == "opswap"  # the next fastest whose file passed
    assert r.to_json()["deploy"]["verified_as"] == {
        "variant": "opswap",
        "shapes": r.verification.shapes,
    }
    monkeypatch.undo()
    # with the export verified (at every shape it claims), compile wins and says so
    monkeypatch.setattr(variants, "race", _faked_race(compile=10.0, opswap=2.0))
    r = optimize(m, (x,), config)
    assert r.best == "compile"
    deploy = r.to_json()["deploy"]
    claimed = r.verification.shapes
    assert len(claimed) > 1  # the example's shape and others
    assert deploy["verified_as"] == {"variant": "captured", "shapes": claimed}
    r.save(tmp_path)
    loaded = opswap.load_optimized(tmp_path)
    other = torch.randn(5, 3, 12, 12)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(other), m(other), rtol=1e-4, atol=1e-5)


def test_nothing_is_saved_as_a_file_that_failed_verification(monkeypatch, tmp_path):
    from opswap.bench import variants

    torch.manual_seed(0)
    m = ConvNet().eval()
    monkeypatch.setattr(variants, "race", _faked_race(opswap=0.5))  # the input wins
    _captured_fails(monkeypatch)
    r = optimize(
        m,
        (torch.randn(2, 3, 12, 12),),
        OptimizeConfig(samples=1, layers=False, measure_rules=False, compare="none"),
    )
    assert r.best == "input"
    paths = r.save(tmp_path)
    assert "model" not in paths and not (tmp_path / "model.pt2").exists()
    deploy = r.to_json()["deploy"]
    assert deploy["verified_as"] is None and deploy["artifact"] is None
    assert "did not pass verification" in deploy["holds"]


def test_a_file_that_fails_only_at_other_sizes_is_saved_static_and_compile_still_wins(
    monkeypatch, tmp_path
):
    import opswap
    from opswap.bench import variants

    torch.manual_seed(0)
    m = ConvNet().eval()
    x = torch.randn(2, 3, 12, 12)
    config = OptimizeConfig(samples=1, layers=False, measure_rules=False)
    monkeypatch.setattr(variants, "race", _faked_race(compile=10.0, opswap=2.0))
    _captured_fails(monkeypatch, at="other sizes")
    r = optimize(m, (x,), config)
    rows = {v.name: v for v in r.variants}
    assert rows["captured"].verified and "keeps every input size" in rows["captured"].note
    assert "injected: wrong output" in rows["captured"].note  # why the sizes were dropped
    assert r.best == "compile"  # never the input while a verified variant is faster
    r.save(tmp_path)
    assert "failed verification" in (tmp_path / "model_shapes.txt").read_text()
    loaded = opswap.load_optimized(tmp_path)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), m(x), rtol=1e-4, atol=1e-5)
        with pytest.raises(OpswapError, match="size"):
            loaded(torch.randn(5, 3, 12, 12))  # the example's sizes only, said in one line


def test_every_unverified_variant_says_why_in_the_result_and_result_json(monkeypatch):
    from opswap.bench import variants

    torch.manual_seed(0)
    monkeypatch.setattr(variants, "race", _faked_race(opswap=0.5))
    _captured_fails(monkeypatch)
    r = optimize(
        ConvNet().eval(),
        (torch.randn(2, 3, 12, 12),),
        OptimizeConfig(samples=1, layers=False, measure_rules=False, compare="none"),
    )
    row = {v.name: v for v in r.variants}["captured"]
    assert not row.verified and "injected: wrong output" in row.reasons
    assert "static sizes, it fails too" in " ".join(row.reasons)
    saved = {v["name"]: v for v in r.to_json()["variants"]}["captured"]
    assert saved["reasons"] == row.reasons
    from opswap.report.document import to_markdown
    from opswap.report.optimize_report import build_report

    md = to_markdown(build_report(r))[0]
    assert "not verified: injected: wrong output" in md
