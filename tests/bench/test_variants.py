"""The variants race: baselines in the same run, only verified variants may win, and the
input wins unless something beats it beyond the run's noise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.bench.variants import VariantTiming, best, build, parse_compare, race
from opswap.errors import OpswapError
from opswap.pipeline import OptimizeConfig, optimize


def _t(name, ms, q1, q3, verified=True):
    return VariantTiming(name, ms, 0.01, 1.0 / ms if ms else None, q1, q3, verified)


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
    assert best([inp, _t("opswap", 0.8, 1.1, 1.3), _t("opswap+compile", 0.5, 1.8, 2.2)]).name \
        == "opswap+compile"
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
    out = {t.name: t for t in race(vs, x, torch.device("cpu"), min_time_s=0.05)}
    assert out["input"].speedup_vs_input == 1.0 and out["captured"].ms > 0
    assert out["opswap"].ms is None and not out["opswap"].verified


def test_optimize_races_torch_compile_and_records_the_winner(tmp_path):
    m = Small().eval()
    r = optimize(m, (torch.randn(4, 16),), OptimizeConfig(samples=1, layers=False,
                                                          measure_rules=False))
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
    r = optimize(m, (torch.randn(4, 16),), OptimizeConfig(samples=1, layers=False,
                                                          measure_rules=False, compare="none"))
    r.best = "input"  # what `best` returns when nothing is faster beyond noise
    assert r.saved_module is r.reference
    assert "unchanged" in r.deploy()["holds"]
