"""bench.runtimes: ONNX Runtime in the race, and the .onnx file an ORT winner saves."""

from __future__ import annotations

import json

import torch
from torch import nn

import opswap
from opswap import artifact
from opswap.bench.runtimes import added, export_winner
from opswap.bench.stats import BenchResult
from opswap.bench.variants import VariantTiming


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean((2, 3)))


def test_export_onnx_races_ort_and_saves_the_timed_file(tmp_path):
    torch.manual_seed(0)
    model = _Net().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 10, 10)
    result = opswap.optimize(model, (x,), compare="none", export="onnx", name="net")
    names = [v.name for v in result.variants]
    assert {"ort", "opswap+ort"} <= set(names)
    rows = {v.name: v for v in result.variants}
    assert rows["ort"].verified and rows["opswap+ort"].verified
    assert result.best in ("ort", "opswap+ort")  # --export onnx saves an .onnx file
    assert "batch 1" in result.verified_as["shapes"]
    timed = result.saved_artifact
    assert timed is not None and timed.path.suffix == ".onnx"
    paths = result.save(tmp_path)
    assert paths["model"] == tmp_path / "model.onnx" and not (tmp_path / "model.pt2").exists()
    assert (tmp_path / "model.onnx").read_bytes() == timed.path.read_bytes()
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["deploy"]["artifact"] == "model.onnx" and data["best"] == result.best
    assert "onnxruntime.InferenceSession" in data["deploy"]["how"]
    loaded = artifact.load(tmp_path)  # in ONNX Runtime
    xb = torch.randn(5, 3, 13, 13)
    with torch.no_grad():
        want = model(xb)
    torch.testing.assert_close(loaded(xb), want, atol=1e-5, rtol=1e-4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _timing(name, ms, ok=True):
    return VariantTiming(name, ms, 0.0, None, None, None, ok)


def _res(rounds):
    from opswap.bench.stats import Stats

    names = list(rounds[0])
    stats = {n: Stats(n, [r[n] for r in rounds], 1) for n in names}
    return BenchResult(stats, rounds, [names] * len(rounds), "cpu", 0)


def test_the_report_says_what_opswap_adds_to_each_runtime():
    ort, mine = _timing("ort", 2.0), _timing("opswap+ort", 1.0)
    ov, ov_mine = _timing("openvino", 1.0), _timing("opswap+openvino", 1.0)
    rounds = [
        {
            "ort": 2.0 + 0.01 * i,
            "opswap+ort": 1.0,
            "openvino": 1.0 + 0.02 * (i % 3 - 1),
            "opswap+openvino": 1.0,
        }
        for i in range(30)
    ]
    files = {"ort", "opswap+ort", "openvino", "opswap+openvino"}
    said = added([ort, mine, ov, ov_mine], files, _res(rounds), "openvino")
    assert said[0].startswith("ONNX Runtime, opswap's file against your model's file: 2.")
    assert "saves" not in said[0] and "noise" not in said[0]
    assert said[1].startswith("OpenVINO") and "within noise" in said[1]
    assert said[1].endswith("so --export saves your model's file (openvino).")
    # an engine whose file failed verification gets no sentence
    assert len(added([ort, mine, ov, ov_mine], files - {"openvino"}, _res(rounds))) == 1


def test_export_winner_needs_opswap_faster_beyond_noise():
    ort, mine = _timing("ort", 2.0), _timing("opswap+ort", 1.0)
    faster = _res([{"ort": 2.0 + 0.01 * i, "opswap+ort": 1.0} for i in range(30)])
    same = _res([{"ort": 1.0 + 0.02 * (i % 3 - 1), "opswap+ort": 1.0} for i in range(30)])
    files = {"ort", "opswap+ort"}
    assert export_winner([ort, mine], files, faster).name == "opswap+ort"
    assert export_winner([ort, mine], files, same).name == "ort"
    assert export_winner([ort, mine], {"ort"}, faster).name == "ort"  # its file failed
    assert export_winner([_timing("ort", None, False), mine], {"opswap+ort"}, faster).name == (
        "opswap+ort"
    )
    assert export_winner([_timing("ort", None, False)], set(), faster) is None


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(48, 96), nn.Linear(96, 40)
        self.head = nn.Linear(40, 40)

    def forward(self, x):
        return self.head(self.down(nn.functional.gelu(self.up(x))) + 1.0)


def test_an_ort_export_plans_no_half_precision_and_says_so(monkeypatch):
    """ONNX Runtime's CPU provider has no bfloat16 GEMM: with --export ort (or onnx) the
    half-precision rules are left out of every plan, with a note; without it they plan."""
    from opswap.config import OptimizeConfig
    from opswap.rules.base import Estimate
    from opswap.rules.precision.bf16 import BF16
    from opswap.stages import capture_stage

    monkeypatch.setattr(BF16, "predict", lambda *a: Estimate(0.0, 0.0, 1e-6, "test"))
    x = torch.randn(3, 48)
    rules = ["precision.bf16"]
    plain = capture_stage(
        _Mlp().eval(), (x,), OptimizeConfig(rules=rules, exactness="approx"), "m", lambda s: None
    )
    assert any(d.rule == "precision.bf16" for d in plain.replan().decisions)
    for export in ("ort", "onnx"):
        config = OptimizeConfig(rules=rules, exactness="approx", export=export)
        run = capture_stage(_Mlp().eval(), (x,), config, "m", lambda s: None)
        assert not run.replan().decisions
        assert any("no bfloat16 or float16 GEMM" in n for n in run.notes)


def test_ort_export_of_static_int8_with_handoffs_runs_in_ort(monkeypatch):
    """--exactness approx --export ort: the static int8 Linears (the up projection handing
    uint8 and its GELU to the down projection) become MatMulInteger in the file ONNX
    Runtime loads, verified against the model like every variant."""
    import onnx

    import opswap.rules.precision._timing as timing

    monkeypatch.setattr(timing, "timed_pair", lambda key, timer, make: (2e-3, 1e-3))
    torch.manual_seed(2)
    model = _Mlp().eval()
    x = torch.randn(6, 48)
    from opswap.config import OptimizeConfig
    from opswap.pipeline import optimize

    config = OptimizeConfig(
        compare="none",
        export="ort",
        exactness="approx",
        rules=["precision.int8_static_*"],
        layers=False,
        measure_rules=False,
        samples=2,
    )
    r = optimize(model, (x,), config, name="mlp")
    rules = [d.rule for d in r.plan.decisions]
    assert rules.count("precision.int8_static_linear") == 3, rules
    assert rules.count("precision.int8_static_handoff") == 1, rules
    rows = {v.name: v for v in r.variants}
    assert rows["opswap+ort"].verified, rows["opswap+ort"].note
    path = r.artifacts["ort_candidate"].path
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MatMulInteger") == 3 and any("Gelu" in o for o in ops)  # BiasGelu too
    assert any("no bfloat16 or float16 GEMM" in n for n in r.notes)
