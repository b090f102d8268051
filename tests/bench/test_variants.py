"""The variants race: baselines in the same run, only verified variants may win, and the
input wins unless something beats it beyond the run's noise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.bench.variants import VariantTiming, best, build, parse_compare, race
from opswap.errors import OpswapError
from opswap.pipeline import OptimizeConfig, optimize


def _t(name, ms, lo, hi, verified=True):
    # lo, hi: the bootstrap interval of the speed-up (the quartiles are not what decides)
    return VariantTiming(name, ms, 0.01, 1.0 / ms if ms else None, lo - 0.1, hi + 0.1, verified,
                         ci_low=lo, ci_high=hi)


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
    timings, res = race(vs, x, torch.device("cpu"), min_time_s=0.05)
    out = {t.name: t for t in timings}
    assert set(res.stats) == {"input", "captured"}
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
    art = r.saved_artifact
    assert art is r.artifacts["input"] and r.saved_module is art.module  # the file timed
    assert "unchanged" in r.deploy()["holds"]
    r.save(tmp_path)
    assert (tmp_path / "model.pt2").read_bytes() == art.path.read_bytes()
    # where the export of the input ran slower than the module, the advice is to keep the module
    import dataclasses
    r.variants = [dataclasses.replace(v, speedup_vs_input=0.9, ci_low=0.85, ci_high=0.95)
                  if v.name == "captured" else v for v in r.variants]
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
    r = optimize(m, (x,), OptimizeConfig(samples=1, layers=False, measure_rules=False,
                                         compare="none"))
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
