"""`--save candidate` (save="candidate"): opswap's model is saved even where it loses the
race, said plainly with its measured speed and accuracy beside the winner's; a candidate
that fails verification is refused in one sentence and nothing is written."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from tests.bench.test_variants import _faked_race
from torch import nn

import opswap
from opswap.artifact import CandidateFailed
from opswap.errors import OpswapError
from opswap.pipeline import OptimizeConfig, optimize


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 5, 1)

    def forward(self, x):
        return self.conv2(torch.relu(self.bn(self.conv(x)))).mean((2, 3))


def _config(**kw):
    return OptimizeConfig(samples=1, layers=False, measure_rules=False, compare="none", **kw)


def _fails(monkeypatch, name: str):
    """The race's variant `name` fails its verification, as if its file were wrong."""
    import dataclasses

    from opswap.bench import variants
    from opswap.verify import outputs

    build, verify = variants.build, outputs.verify

    def tagged(*args, **kwargs):
        vs = build(*args, **kwargs)
        for v in vs:
            if v.name == name:
                v.fn._injected_wrong = True
        return vs

    def check(model, fn, *args, **kwargs):
        out = verify(model, fn, *args, **kwargs)
        if getattr(fn, "_injected_wrong", False):
            return dataclasses.replace(out, passed=False, reasons=["injected: wrong output"])
        return out

    monkeypatch.setattr(variants, "build", tagged)
    monkeypatch.setattr(outputs, "verify", check)
    monkeypatch.setattr(variants, "_static_fallback", lambda *a, **k: None)


def test_the_candidate_is_saved_when_it_loses_and_says_so(monkeypatch, tmp_path):
    from opswap.bench import variants
    from opswap.report.document import to_markdown
    from opswap.report.optimize_report import build_report

    torch.manual_seed(0)
    m, x = ConvNet().eval(), torch.randn(3, 3, 10, 7)
    monkeypatch.setattr(variants, "race", _faked_race(opswap=0.5, captured=0.8))  # opswap's loses
    plain = optimize(m, (x,), _config())
    assert plain.best == "input" and plain.race_winner is None
    assert plain.to_json()["save"]["kept_by_request"] is False

    r = optimize(m, (x,), _config(save="candidate"))
    assert r.applied and r.best == "opswap" and r.race_winner == "input"
    assert r.saved_artifact is r.artifacts["candidate"]
    assert "saved opswap by request, 0.50x the input (the race's winner: input))" in repr(r)
    data = r.to_json()
    save = data["save"]
    assert save["asked"] == "candidate" and save["kept_by_request"] is True
    assert save["saved"]["variant"] == "opswap" and save["saved"]["speedup_vs_input"] == 0.5
    assert save["saved"]["speedup_ci"] == pytest.approx([0.45, 0.55])
    assert save["winner"]["variant"] == "input" and save["winner"]["accuracy"]["reference"]
    acc = save["saved"]["accuracy"]
    assert acc["passed"] and acc["metric"] and acc["budget"] and acc["value"] is not None
    assert "kept by request (--save candidate)" in data["deploy"]["holds"]
    assert "its speed-up over your model: " in data["deploy"]["holds"]
    assert "0.50x" in data["deploy"]["holds"] and "[0.45-0.55]" in data["deploy"]["holds"]

    paths = r.save(tmp_path)
    assert (tmp_path / "model.pt2").read_bytes() == r.artifacts["candidate"].path.read_bytes()
    assert json.loads(paths["result"].read_text())["save"]["kept_by_request"] is True
    md = to_markdown(build_report(r))[0]
    assert "Kept by request (--save candidate): `opswap`" in md
    assert "`opswap` (saved, by request)" in md and "`input` (the race's winner)" in md
    loaded = opswap.load_optimized(tmp_path)
    for batch in (1, 3, 6):  # the saved candidate at other batch sizes too
        xb = torch.randn(batch, 3, 10, 7)
        with torch.inference_mode():
            torch.testing.assert_close(loaded(xb), m(xb), rtol=1e-4, atol=1e-5)


def test_a_candidate_that_won_is_saved_as_the_winner(monkeypatch):
    from opswap.bench import variants

    torch.manual_seed(0)
    monkeypatch.setattr(variants, "race", _faked_race(opswap=3.0))
    r = optimize(ConvNet().eval(), (torch.randn(2, 3, 9, 9),), _config(save="candidate"))
    assert r.best == "opswap" and r.race_winner is None
    assert r.to_json()["save"]["kept_by_request"] is False
    assert "kept by request" not in r.to_json()["deploy"]["holds"]


def test_a_candidate_whose_file_fails_is_refused_in_one_sentence(monkeypatch):
    from opswap.bench import variants

    torch.manual_seed(0)
    monkeypatch.setattr(variants, "race", _faked_race(opswap=0.5, captured=0.8))
    _fails(monkeypatch, "opswap")
    m, x = ConvNet().eval(), (torch.randn(2, 3, 8, 8),)
    assert optimize(m, x, _config()).best == "input"  # the default saves the input
    with pytest.raises(CandidateFailed) as caught:
        optimize(m, x, _config(save="candidate"))
    said = str(caught.value)
    assert said.startswith("--save candidate: opswap's opswap did not pass verification")
    assert "injected: wrong output" in said and said.endswith(".") and "\n" not in said


def test_a_candidate_that_fails_in_memory_is_refused():
    from tests.test_pipeline import _Wrong

    from opswap.rules import registry

    registry.register(_Wrong)
    try:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3)).eval()
        config = OptimizeConfig(rules=["test.wrong"], rollback=False, bench=False, save="candidate")
        with pytest.raises(CandidateFailed, match=r"^--save candidate: opswap's candidate did not"):
            optimize(m, (torch.randn(4, 12),), config)
    finally:
        registry._RULES.pop(_Wrong.name, None)


def test_with_export_the_candidate_is_opswaps_onnx_file(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from opswap.bench import variants

    torch.manual_seed(0)
    m, x = ConvNet().eval(), torch.randn(2, 3, 9, 8)
    from opswap.bench import runtimes

    # opswap's .onnx file loses to your model's: --export onnx alone would save the latter
    monkeypatch.setattr(variants, "race", _faked_race(opswap_ort=0.5, ort=2.0, captured=0.8))
    monkeypatch.setattr(
        runtimes,
        "export_winner",
        lambda ts, ok, res, engine: next(t for t in ts if t.name == engine),
    )
    assert optimize(m, (x,), _config(export="onnx")).best == "ort"
    r = optimize(m, (x,), _config(export="onnx", save="candidate"))
    assert r.best == "opswap+ort" and r.race_winner == "ort"
    assert "kept by request" in r.to_json()["deploy"]["holds"]
    assert r.saved_artifact is r.artifacts["ort_candidate"]
    r.save(tmp_path)
    assert (tmp_path / "model.onnx").read_bytes() == r.artifacts["ort_candidate"].path.read_bytes()
    assert not (tmp_path / "model.pt2").exists()
    loaded = opswap.load_optimized(tmp_path)
    xb = torch.randn(3, 3, 9, 8)
    torch.testing.assert_close(loaded(xb), m(xb), rtol=1e-4, atol=1e-4)


def test_a_candidate_with_no_rule_applied_says_it_is_the_capture(monkeypatch):
    from opswap.bench import variants

    torch.manual_seed(0)
    monkeypatch.setattr(variants, "race", _faked_race(opswap=0.5, captured=0.8))
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh()).eval()  # nothing for a rule to do
    r = optimize(m, (torch.randn(3, 6),), _config(save="candidate"))
    assert not r.applied and r.best == "opswap" and r.race_winner == "input"
    assert r.to_json()["deploy"]["holds"].endswith("it computes your model as captured")


def test_save_takes_winner_or_candidate_only():
    with pytest.raises(OpswapError) as caught:
        OptimizeConfig(save="best")
    assert str(caught.value) == "save must be winner or candidate; got 'best'."


MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1)
            self.bn = nn.BatchNorm2d(6)
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


    def build():
        torch.manual_seed(0)
        return Net().eval(), (torch.randn(2, 3, 8, 6),)
    """
)


def _cli(*args) -> int:
    from opswap.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code or 0
    return 0


def test_cli_save_candidate(monkeypatch, tmp_path, capsys):
    from opswap.bench import variants

    (tmp_path / "net.py").write_text(MODEL)
    monkeypatch.setattr(variants, "race", _faked_race(opswap=0.5, captured=0.8))
    args = ("optimize", tmp_path / "net.py:build", "--compare", "none", "--samples", "1")
    assert _cli(*args, "--save", "candidate", "--out", tmp_path / "out") == 0
    out = capsys.readouterr().out
    assert "Kept by request (--save candidate): `opswap`" in out
    assert "opswap (saved, by request)" in out and "input (the race's winner)" in out
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    assert data["best"] == "opswap" and data["save"]["race_winner"] == "input"
    assert all("accuracy" in v for v in data["variants"])

    assert _cli(*args, "--save", "best", "--out", tmp_path / "bad") == 2  # a usage error
    err = capsys.readouterr().err
    assert "save must be winner or candidate; got 'best'." in err
    assert not (tmp_path / "bad").exists()

    _fails(monkeypatch, "opswap")
    assert _cli(*args, "--save", "candidate", "--out", tmp_path / "refused") == 1
    err = capsys.readouterr().err
    assert "--save candidate: opswap's opswap did not pass verification" in err
    assert not (tmp_path / "refused").exists()  # nothing half-written
