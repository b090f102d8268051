"""backends.runtime_layers, and `verify` / `bench` with a runtime backend: every value a
runtime computes compared with PyTorch running the same exported graph, and the first
one that differs found."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from opswap import api, planner
from opswap.backends import onnx as onnx_backend
from opswap.backends.pt2 import export
from opswap.backends.runtime_layers import RUNTIMES, runtime_layers
from opswap.errors import ExportError
from opswap.graph.dynamic import variants
from opswap.targets import get_target

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")


class Net(nn.Module):
    """In-place ReLU, a residual, eval BatchNorm (running stats are buffers), a softmax."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.b = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.c = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu_(self.a(x))
        h = h + self.b(h)
        return self.c(self.norm(h)).softmax(-1)


def _net():
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():  # running stats that are not the defaults
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(3, 12),)


def _broken(monkeypatch, initializer: str, by: float = 1.0):
    """Every ONNX translation from now on adds `by` to the weight `initializer` in the file
    (PyTorch's side, the translated program, keeps it)."""
    real = onnx_backend.translate

    def translate(program, **kw):
        onnx_program = real(program, **kw)
        value = onnx_program.model.graph.initializers[initializer]
        arr = value.const_value.numpy() + np.float32(by)
        from onnxscript import ir

        value.const_value = ir.tensor(arr, name=initializer)
        return onnx_program

    monkeypatch.setattr(onnx_backend, "translate", translate)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_value_matches_pytorch_at_another_batch(runtime):
    model, xs = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = api.capture(model, xs)
    program, _, _ = export(captured.gm, captured.example_inputs, captured.dynamic)
    other = dict(variants(captured.example_inputs, captured.dynamic))["batch 1"]
    report = runtime_layers(program, runtime, other)
    compared = [r for r in report.rows if r.metrics is not None]
    # the three Linears, the ReLU, the residual add and the softmax at least
    assert {r.module for r in compared} >= {"a", "b", "c"}
    assert any(r.op == "softmax" for r in compared)
    assert report.first_divergence("exact") is None, report.table()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_value_changed_in_the_file_is_the_first_divergence(runtime, monkeypatch):
    model, xs = _net()
    captured = api.capture(model, xs)
    program, _, _ = export(captured.gm, captured.example_inputs, captured.dynamic)
    _broken(monkeypatch, "b.bias")
    report = runtime_layers(program, runtime, captured.example_inputs)
    first = report.first_divergence("exact")
    assert first is not None and first.row.module == "b" and first.row.op == "linear"
    before = [r for r in report.rows[: first.index] if r.metrics is not None]
    assert any(r.module == "a" for r in before)  # a's rows came first, and matched
    after = [r for r in report.rows[first.index + 1 :] if r.metrics is not None]
    assert after and max(r.metrics.rel_l2 for r in after) > 1e-3  # it carries on downstream


def test_executorch_has_no_layers_and_says_why():
    model, xs = _net()
    program, _, _ = export(model, xs, None)
    with pytest.raises(ExportError, match="keeps them inside its delegate"):
        runtime_layers(program, "executorch", xs)


def _plan(model, xs, tmp_path):
    captured = api.capture(model, xs)
    plan = planner.make_plan(captured, target=get_target("cpu"), rules=["fusion.*"])
    return plan.save(tmp_path / "plan.json")


@pytest.mark.parametrize("backend", ["openvino", "executorch"])
def test_verify_plan_in_a_runtime_passes_without_layers_unless_asked(backend, tmp_path):
    if backend == "executorch":
        pytest.importorskip("executorch")
    model, xs = _net()
    plan = _plan(model, xs, tmp_path)
    check = api.verify_plan(model, xs, plan, backend=backend)
    assert check.verification.passed and check.runtime_layers is None
    labels = {s for s in check.verification.shapes}
    assert len(labels) >= 2  # the example and another batch
    asked = api.verify_plan(model, xs, plan, backend=backend, layers=True)
    if backend == "executorch":
        assert "inside the XNNPACK delegate" in asked.runtime_layers
    else:
        assert asked.runtime_layers.rows and asked.runtime_divergence is None


def test_a_failing_runtime_verification_points_at_the_value(monkeypatch, tmp_path):
    model, xs = _net()
    plan = _plan(model, xs, tmp_path)
    _broken(monkeypatch, "b.bias")  # (not c's: the softmax would hide a shift of all logits)
    check = api.verify_plan(model, xs, plan, backend="ort")
    assert not check.verification.passed
    # PyTorch's side holds, so the layer table of the plan finds nothing; ORT's does
    assert check.first_divergence is None
    first = check.runtime_divergence
    assert first is not None and first.row.module == "b", check.runtime_layers.table()


def test_bench_plan_times_both_files_in_openvino(tmp_path):
    model, xs = _net()
    plan = _plan(model, xs, tmp_path)
    timed = api.bench_plan(model, xs, plan, backend="openvino")
    assert timed.benchmark.ref_ms > 0 and timed.benchmark.opt_ms > 0
    with pytest.raises(ExportError, match="use --device cpu"):
        api.bench_plan(model, xs, plan, backend="openvino", device="cuda")
    with pytest.raises(ExportError, match="Unknown backend 'tensorrt'"):
        api.bench_plan(model, xs, plan, backend="tensorrt")


def _run(*args) -> int:
    from opswap.cli import main

    try:
        main(list(args))
    except SystemExit as e:
        return e.code or 0
    return 0


def test_cli_verify_layers_in_openvino_writes_the_rows(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    small = ("--set", "width=4", "--set", "image_size=8")
    assert _run("plan", "zoo:resnet", *small, "-o", str(plan)) == 0
    out = tmp_path / "v.json"
    args = ("verify", "zoo:resnet", *small, str(plan), "--backend", "openvino", "--layers")
    capsys.readouterr()
    assert _run(*args, "--json", str(out)) == 0
    assert "openvino layer by layer" in capsys.readouterr().out
    data = json.loads(out.read_text())["runtime_layers"]
    assert data["rows"] and data["first_divergence"] is None
    assert _run("verify", "zoo:resnet", *small, str(plan), "--backend", "trt") != 0
    said = capsys.readouterr()
    assert "Unknown backend 'trt'" in said.out + said.err


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_static_int8_linears_are_compared_by_name(runtime):
    from opswap.graph.calibrate import Calibration, attach
    from opswap.targets.base import Target
    from opswap.verify.samples import make_samples

    model, xs = _net()
    captured = api.capture(model, xs)
    attach(captured.gm, Calibration(make_samples(captured.example_inputs, 4, seed=1)))
    pays = Target(
        name="int8-pays",
        description="int8 at 4x float32, so that the int8 rule is planned",
        kind="cpu",
        peak_flops={"float32": 1e11, "int8": 4e11},
        mem_bandwidth=2e10,
        memory_bytes=2**34,
        dtypes=("float32", "int8"),
    )
    plan = planner.make_plan(
        captured, rules=["precision.int8_static_linear"], exactness="approx", target=pays
    )
    applied = planner.apply_plan(captured, plan)
    sites = {s.data["linear"] for s in applied.applied}
    assert sites  # (the rule leaves out Linears it predicts no gain for)
    program, _, _ = export(applied.gm, captured.example_inputs, captured.dynamic)
    form = "integer" if runtime == "ort" else "qdq"  # as each runtime's file is written
    report = runtime_layers(program, runtime, captured.example_inputs, int8=form)
    int8 = [r for r in report.rows if r.metrics is not None and "int8_static_linear" in r.name]
    assert {r.module for r in int8} == sites
    # the same int8 codes in both: only a value exactly on a half step may round apart
    assert report.first_divergence("cosine>=0.9999") is None, report.table()
