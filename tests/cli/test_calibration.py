"""The int8 model as a file, from the command line: `opswap optimize --exactness approx
--calibration FILE` writes a plan.json that `opswap apply` and `opswap export --to onnx`
turn back into the int8 model with no samples (exit 0, int8 operators in the file); with
other weights they refuse in one sentence naming --calibration, and calibrate again when
it is given; a spec file's calibration() is what `opswap plan` calibrates on."""

from __future__ import annotations

import collections
import json
import textwrap

import pytest
import torch

import opswap.rules.precision._timing as timing
from opswap.cli import main
from opswap.kernels import int8_static

pytestmark = pytest.mark.skipif(
    not int8_static.onednn_available(), reason="onednn's int8 kernels need an x86 CPU torch"
)

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
            self.fc = nn.Linear(16, 24)
            self.head = nn.Linear(24, 5)

        def forward(self, x):
            x = torch.relu(self.bn(self.c1(x)))
            x = torch.relu(self.c2(x))
            return self.head(torch.relu(self.fc(x.mean((2, 3)))))


    def build(batch=3):
        torch.manual_seed(0)
        return Tiny().eval(), (torch.randn(batch, 3, 9, 11),)


    def calibration(batch=3):
        g = torch.Generator().manual_seed(1)
        return [(torch.rand(batch, 3, 9, 11, generator=g) * 5,) for _ in range(2)]
    """
)


def run(*args) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code or 0
    return 0


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """tiny.py, a calibration file, and `opswap optimize`'s output made with them (int8
    timed as paying, whatever this machine's timing says: that is a benchmark's business)."""
    root = tmp_path_factory.mktemp("calib")
    (root / "tiny.py").write_text(MODEL)
    (root / "plain.py").write_text(MODEL[: MODEL.index("def calibration")])
    g = torch.Generator().manual_seed(2)  # seeded: which int8 sites verify depends on it
    torch.save(torch.randn(14, 3, 9, 11, generator=g), root / "cal.pt")  # 4 batches of 3, 2 over
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing, "timed_pair", lambda key, timer, make: (2e-3, 1e-3))
        code = run(
            "optimize", root / "tiny.py:build", "--exactness", "approx", "--no-bench",
            "--rules", "fusion.*,precision.int8_static_*", "--calibration", root / "cal.pt",
            "--out", root / "out",
        )  # fmt: skip
    assert code == 0
    return root


def _int8_count(plan) -> int:
    return sum(d["rule"].startswith("precision.int8_static_") for d in plan["decisions"])


def test_optimize_keeps_the_files_calibration_in_plan_json(made, capsys):
    plan = json.loads((made / "out" / "plan.json").read_text())
    assert _int8_count(plan) >= 3, plan["decisions"]
    cal = plan["calibration"]
    assert (cal["samples"], cal["source"], cal["method"]) == (4, "batches from cal.pt", "minmax")
    notes = json.loads((made / "out" / "result.json").read_text())["notes"]
    assert any("Static int8 calibrated on 4 batches from cal.pt" in n for n in notes)


def test_plan_json_applies_and_exports_to_int8_onnx_with_exit_0(made, capsys):
    import onnx

    plan_path = made / "out" / "plan.json"
    n = _int8_count(json.loads(plan_path.read_text()))
    spec = made / "tiny.py:build"
    assert run("apply", spec, plan_path, "--out", made / "applied") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "static int8 scales as the plan holds them (calibrated on 4 batches from cal.pt" in out
    assert "applied" in out and "not applied" not in out
    program = torch.export.load(made / "applied" / "model.pt2")
    assert sum("int8_static" in str(node.target) for node in program.graph.nodes) >= 2

    assert run("export", spec, plan_path, "--to", "onnx", "--out", made / "onnx") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "verification PASSED" in out and "not applied" not in out
    ops = collections.Counter(
        node.op_type for node in onnx.load(made / "onnx" / "model.onnx").graph.node
    )
    int8 = ops["QuantizeLinear"] + ops["DynamicQuantizeLinear"] + ops["MatMulInteger"]
    assert ops["QuantizeLinear"] >= 1 and int8 >= n - 1, ops  # a handoff shares one quantise


def test_other_weights_are_refused_naming_the_option_then_calibrated(made, capsys):
    torch.manual_seed(5)
    other = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in _state(made).items()}  # fmt: skip
    torch.save(other, made / "other.pt")
    plan_path = made / "out" / "plan.json"
    capsys.readouterr()
    # plain.py has the model but no calibration(): nothing to calibrate on
    assert run("apply", made / "plain.py:build", plan_path, "--weights", made / "other.pt") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "other weights than this model's" in err and "pass --calibration FILE" in err
    assert "Traceback" not in err
    code = run(
        "apply", made / "plain.py:build", plan_path, "--weights", made / "other.pt",
        "--calibration", made / "cal.pt",
    )  # fmt: skip
    assert code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "static int8 calibrated on 4 batches from cal.pt" in out
    # tiny.py's calibration() is what the command takes without --calibration
    assert run("apply", made / "tiny.py:build", plan_path, "--weights", made / "other.pt") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "static int8 calibrated on 2 batches from calibration() in tiny.py" in out


def test_a_missing_calibration_file_fails_before_loading(made, capsys):
    spec, plan_path = made / "tiny.py:build", made / "out" / "plan.json"
    for args in (
        ("apply", spec, plan_path),
        ("export", spec, plan_path, "--to", "onnx"),
        ("optimize", spec, "--exactness", "approx"),
    ):
        assert run(*args, "--calibration", made / "nope.pt") == 2
        err = capsys.readouterr().err
        assert "No calibration file at" in err and "nope.pt" in err


def test_plan_calibrates_on_the_spec_files_calibration(made, monkeypatch):
    monkeypatch.setattr(timing, "timed_pair", lambda key, timer, make: (2e-3, 1e-3))
    out = made / "spec_plan.json"
    assert run(
        "plan", made / "tiny.py:build", "--exactness", "approx", "--rules",
        "fusion.*,precision.int8_static_*", "--out", out,
    ) == 0  # fmt: skip
    plan = json.loads(out.read_text())
    assert plan["calibration"]["source"] == "batches from calibration() in tiny.py"
    assert plan["calibration"]["samples"] == 2
    first = next(d for d in plan["decisions"] if d["rule"] == "precision.int8_static_conv")
    assert first["site"]["data"]["zero_point"] == 0  # calibration() draws from [0, 5)


def _state(made) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_for_weights", made / "tiny.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()[0].state_dict()


def test_verify_and_export_of_a_plan_judge_on_the_given_data(made, capsys):
    """Given --calibration, `opswap verify` and `opswap export` judge the plan's result on
    those batches (a quarter held out of calibration from 8 batches up), as optimize does,
    not on random samples like the example."""
    g = torch.Generator().manual_seed(1)  # the spec's calibration() data, 10 batches of 3
    torch.save(torch.rand(30, 3, 9, 11, generator=g) * 5, made / "big.pt")
    plan_path, spec = made / "out" / "plan.json", made / "tiny.py:build"
    capsys.readouterr()
    # int8 on this tiny net changes the top-1 class of about 1.5% of its rows on this data,
    # past the approx default of 1%: a budget that says so, which the output must show
    code = run(
        "verify", spec, plan_path, "--calibration", made / "big.pt", "--budget", "top1>=0.95"
    )
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "top1>=0.95" in out, out
    assert "static int8 calibrated on 8 batches from big.pt" in out, out
    assert "verified on 2 batches from big.pt held out of calibration" in out, out
    code = run("export", spec, plan_path, "--to", "onnx", "--out", made / "onnx_big",
               "--calibration", made / "cal.pt")  # fmt: skip
    assert code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "verified on the 4 batches from cal.pt calibration ran on" in out, out
