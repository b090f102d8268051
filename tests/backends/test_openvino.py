"""backends.openvino: an OpenVINO compiled model called like the module it came from."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import opswap
from opswap import api, planner
from opswap.backends.openvino import OpenVinoModule, compile_file, openvino_artifact
from opswap.errors import ExportError, InputError
from opswap.graph.dynamic import variants
from opswap.targets import get_target


def _runs_like(model, art, captured, atol=1e-4):
    shapes = [("example", captured.example_inputs)] + variants(
        captured.example_inputs, captured.dynamic
    )
    labels = [s for s, _ in shapes]
    assert "batch 1" in labels and len(labels) >= 3, labels  # batch 1 and a larger batch
    for _, xs in shapes:
        with torch.no_grad():
            want = model(*xs)
        got = art.module(*xs)
        assert type(got) is type(want)  # the output structure comes back
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    return labels


def test_tiny_resnet_with_conv_bn_and_conv_relu_fired_runs_in_openvino(tmp_path):
    loaded = api.load("zoo:resnet", width="4", image_size="8")
    model = loaded.module.eval()  # BatchNorm in eval: its running stats are buffers
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = api.capture(model, loaded.example_inputs)
    rules = ["fusion.conv_bn", "fusion.conv_relu"]
    plan = planner.make_plan(captured, target=get_target("cpu"), rules=rules)
    applied = planner.apply_plan(captured, plan)
    assert set(rules) <= {s.rule for s in applied.applied}
    art = openvino_artifact(applied.gm, captured.example_inputs, captured.dynamic, tmp_path)
    assert isinstance(art.module, OpenVinoModule), art.error
    assert art.module.session_threads == torch.get_num_threads()
    _runs_like(model, art, captured)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_tiny_bert_runs_in_openvino_at_other_batches_and_lengths(tmp_path):
    loaded = api.load("zoo:bert", hidden="32", layers="1", heads="2", intermediate="64", seq="12")
    model = loaded.module.eval()
    captured = api.capture(model, loaded.example_inputs)
    art = openvino_artifact(model, captured.example_inputs, captured.dynamic, tmp_path)
    assert art.module is not None, art.error
    labels = _runs_like(model, art, captured)
    assert any(s.startswith("seq") for s in labels)
    other = copy.deepcopy(art.module)  # a compiled model is not copied: it compiles anew
    assert other.compiled is not art.module.compiled
    xs = captured.example_inputs
    torch.testing.assert_close(other(*xs), art.module(*xs))


def test_wrong_inputs_are_refused_in_one_sentence(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.ReLU()).eval()
    art = openvino_artifact(model, (torch.randn(4, 6),), None, tmp_path)
    mod = art.module
    assert isinstance(mod, OpenVinoModule), art.error
    with pytest.raises(InputError, match="takes 1 input tensor"):
        mod(torch.randn(4, 6), torch.randn(4, 6))
    with pytest.raises(InputError, match="refused the inputs"):
        mod(torch.randn(4, 7))
    with pytest.raises(InputError, match="bfloat16"):
        mod(torch.randn(4, 6, dtype=torch.bfloat16))


def test_compare_takes_openvino_as_a_baseline():
    from opswap.bench.variants import parse_compare

    assert parse_compare("openvino") == ["openvino"]
    assert parse_compare("ort,openvino") == ["ort", "openvino"]


def test_a_file_openvino_cannot_compile_is_an_export_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ExportError, match="OpenVINO could not compile bad.onnx"):
        compile_file(bad)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6)
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean((2, 3)))


def test_compare_openvino_races_both_exports_and_a_winner_saves_its_onnx_file(tmp_path):
    torch.manual_seed(0)
    model = _Net().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 10, 10)
    rules = ["fusion.conv_bn", "fusion.conv_relu"]
    result = opswap.optimize(model, (x,), rules=rules, compare="openvino", name="net", samples=1)
    rows = {v.name: v for v in result.variants}
    assert {"openvino", "opswap+openvino"} <= set(rows) and "ort" not in rows
    for name in ("openvino", "opswap+openvino"):
        assert rows[name].verified and rows[name].ms is not None, rows[name].note
        assert rows[name].note.startswith("model.onnx in OpenVINO (CPU")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # what an OpenVINO winner saves: the very file that was timed, and how to run it
    timed = result.artifacts["openvino_candidate"]
    won = dataclasses.replace(
        result, best="opswap+openvino", verified_as={"variant": "opswap+openvino", "shapes": []}
    )
    paths = won.save(tmp_path)
    assert paths["model"] == tmp_path / "model.onnx" and not (tmp_path / "model.pt2").exists()
    assert (tmp_path / "model.onnx").read_bytes() == timed.path.read_bytes()
    deploy = json.loads((tmp_path / "result.json").read_text())["deploy"]
    assert deploy["artifact"] == "model.onnx" and deploy["run_under"] == "openvino (CPU)"
    assert "openvino.Core().compile_model" in deploy["how"]
    xb = torch.randn(5, 3, 13, 13)
    with torch.no_grad():
        want = model(xb)
    saved = OpenVinoModule(tmp_path / "model.onnx")
    torch.testing.assert_close(saved(xb), want, atol=1e-5, rtol=1e-4)
