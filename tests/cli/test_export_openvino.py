"""`--export openvino` (opswap optimize) and `--to openvino` (opswap export): OpenVINO's
IR written, verified and loadable, and the refusals before any work."""

from __future__ import annotations

import json

import pytest
import torch

import opswap
from opswap.cli import main

SMALL = ("--set", "width=4", "--set", "image_size=8", "--set", "batch=2")


def run(*args) -> int:
    try:
        main(list(args))
    except SystemExit as e:
        return e.code or 0
    return 0


def _runs_at_another_batch(out):
    loaded = opswap.load("zoo:resnet", width="4", image_size="8")
    model = loaded.module.eval()
    (x,) = loaded.example_inputs
    xb = torch.randn(3, *x.shape[1:])
    with torch.no_grad():
        want = model(xb)
    torch.testing.assert_close(opswap.load_optimized(out)(xb), want, atol=1e-4, rtol=1e-4)


NET = """
import torch
from torch import nn


def build(batch: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4),
    ).eval()
    model[1].running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(batch, 3, 10, 10),)
"""


def test_optimize_export_openvino_saves_the_ir(tmp_path, capsys):
    (tmp_path / "net.py").write_text(NET)
    spec, out = f"{tmp_path / 'net.py'}:build", tmp_path / "o"
    args = ("--rules", "fusion.conv_bn", "--compare", "none", "--samples", "1")
    assert run("optimize", spec, *args, "--export", "openvino", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert (out / "model.xml").is_file() and (out / "model.bin").is_file()
    assert not (out / "model.pt2").exists() and not (out / "model.onnx").exists()
    data = json.loads((out / "result.json").read_text())
    assert data["settings"]["export"] == "openvino"
    assert data["best"] in ("openvino", "opswap+openvino")
    assert data["deploy"]["artifact"] == "model.xml" and data["deploy"]["reloaded"]["passed"]
    assert "model.xml in OpenVINO" in printed and 'compile_model("DIR/model.xml"' in printed
    loaded = opswap.load(spec)
    xb = torch.randn(5, 3, 10, 10)
    with torch.no_grad():
        want = loaded.module(xb)
    torch.testing.assert_close(opswap.load_optimized(out)(xb), want, atol=1e-4, rtol=1e-4)


def test_export_to_openvino_writes_the_plans_ir(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    rules = "fusion.conv_bn,fusion.conv_relu"
    assert run("plan", "zoo:resnet", *SMALL, "--rules", rules, "--out", str(plan)) == 0
    out = tmp_path / "ir"
    j = tmp_path / "e.json"
    code = run("export", "zoo:resnet", *SMALL, str(plan), "--to", "openvino", "--out", str(out),
               "--samples", "1", "--json", str(j))  # fmt: skip
    assert code == 0, capsys.readouterr().err
    printed = " ".join(capsys.readouterr().out.split())
    assert f"wrote {out / 'model.xml'}" in printed
    assert '{"INFERENCE_PRECISION_HINT": "f32"}' in printed  # how to load it as verified
    data = json.loads(j.read_text())
    assert data["model"].endswith("model.xml") and data["verification"]["passed"]
    assert "batch 1" in data["verification"]["shapes"]
    _runs_at_another_batch(out)


@pytest.fixture
def no_openvino(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "openvino" else real(n, *a)
    )

    def _load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("opswap.cli.commands._load", _load)


@pytest.mark.parametrize(
    "args",
    [
        ("optimize", "zoo:resnet", "--export", "openvino"),
        ("export", "zoo:resnet", "plan.json", "--to", "openvino"),
    ],
)
def test_openvino_missing_is_one_sentence_naming_the_extra(tmp_path, capsys, no_openvino, args):
    out = ("--out", str(tmp_path / "o"))
    assert run(*args, *out) != 0
    err = capsys.readouterr().err
    assert "needs openvino; install it with pip install 'opswap[openvino]'" in err
    assert "Traceback" not in err and not (tmp_path / "o" / "model.xml").exists()


def test_an_unknown_export_format_lists_openvino(tmp_path, capsys):
    assert run("optimize", "zoo:resnet", "--export", "tflite", "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert "tflite" in err and "openvino" in err
