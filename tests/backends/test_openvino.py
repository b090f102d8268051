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
from opswap.errors import ExportError, InputError, OpswapError
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


# --export openvino / --to openvino: OpenVINO's own IR (model.xml + model.bin), timed as saved


def _ir_types(xml) -> set[str]:
    """The element types of the IR's constants and ports: float32 weights stay f32."""
    import re

    return set(re.findall(r'element_type="(\w+)"', xml.read_text()))


def _fresh_core(xml, *xs):
    """The IR run in a Core of its own, outside opswap: what a deployment does."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return [torch.from_numpy(o) for o in compiled([x.numpy() for x in xs]).values()]


def test_export_openvino_races_both_irs_and_saves_the_timed_ir(tmp_path):
    torch.manual_seed(0)
    model = _Net().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 10, 10)
    result = opswap.optimize(
        model, (x,), rules=["fusion.conv_bn"], compare="none", export="openvino", samples=1
    )
    rows = {v.name: v for v in result.variants}
    assert {"openvino", "opswap+openvino"} <= set(rows) and "ort" not in rows
    for name in ("openvino", "opswap+openvino"):
        assert rows[name].verified and rows[name].ms is not None, rows[name].note
        assert rows[name].note.startswith("model.xml in OpenVINO (CPU")
    assert result.best in ("openvino", "opswap+openvino")  # --export openvino saves an IR
    assert "batch 1" in result.verified_as["shapes"]
    timed = result.saved_artifact
    assert timed is not None and timed.path.suffix == ".xml"
    paths = result.save(tmp_path)
    assert paths["model"] == tmp_path / "model.xml" and (tmp_path / "model.bin").is_file()
    for other in ("model.pt2", "model.onnx", "model.pte"):
        assert not (tmp_path / other).exists(), other
    assert (tmp_path / "model.xml").read_bytes() == timed.path.read_bytes()
    assert (tmp_path / "model.bin").read_bytes() == timed.path.with_suffix(".bin").read_bytes()
    assert "f16" not in _ir_types(tmp_path / "model.xml")  # compress_to_fp16=False
    deploy = json.loads((tmp_path / "result.json").read_text())["deploy"]
    assert deploy["artifact"] == "model.xml" and deploy["run_under"] == "openvino (CPU)"
    assert 'compile_model("DIR/model.xml"' in deploy["how"]
    assert deploy["reloaded"]["passed"] and "batch 1" in deploy["reloaded"]["shapes"]
    loaded = opswap.load_optimized(tmp_path)  # in OpenVINO, from the IR alone
    assert isinstance(loaded, OpenVinoModule) and loaded.path.name == "model.xml"
    xb = torch.randn(5, 3, 13, 13)  # another batch and another image size
    with torch.no_grad():
        want = model(xb)
    torch.testing.assert_close(loaded(xb), want, atol=1e-5, rtol=1e-4)
    (got,) = _fresh_core(tmp_path / "model.xml", xb)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # an IR that does not match the model once loaded back is not saved, and DIR is kept
    shifted = copy.deepcopy(result.reference)
    with torch.no_grad():
        shifted.fc.bias.add_(1.0)
    broken = dataclasses.replace(result, reference=shifted)
    with pytest.raises(OpswapError, match="does not match your model when loaded back"):
        broken.save(tmp_path)
    assert (tmp_path / "model.xml").read_bytes() == timed.path.read_bytes()


def test_to_openvino_writes_a_verified_ir_of_a_plan_with_conv_bn_and_conv_relu(tmp_path):
    loaded = api.load("zoo:resnet", width="4", image_size="8")
    model = loaded.module.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = api.capture(model, loaded.example_inputs)
    rules = ["fusion.conv_bn", "fusion.conv_relu"]
    plan = planner.make_plan(captured, target=get_target("cpu"), rules=rules)
    done = api.export(model, loaded.example_inputs, plan, to="openvino", out=tmp_path, samples=1)
    assert set(rules) <= {s.rule for s in done.replay.applied.applied}
    assert done.path == tmp_path / "model.xml" and (tmp_path / "model.bin").is_file()
    assert not (tmp_path / "model.onnx").exists()
    assert done.verification.passed, done.verification.reasons
    assert "batch 1" in done.verification.shapes and len(done.verification.shapes) >= 3
    assert "f16" not in _ir_types(done.path)
    (x,) = loaded.example_inputs
    xb = torch.randn(3, *x.shape[1:])  # a batch other than the example's
    with torch.no_grad():
        want = model(xb)
    (got,) = _fresh_core(done.path, xb)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_tiny_bert_ir_keeps_batch_and_length_dynamic_and_its_output_structure(tmp_path):
    loaded = api.load("zoo:bert", hidden="32", layers="1", heads="2", intermediate="64", seq="12")
    model = loaded.module.eval()
    captured = api.capture(model, loaded.example_inputs)
    art = openvino_artifact(model, captured.example_inputs, captured.dynamic, tmp_path, ir=True)
    assert art.module is not None and art.path == tmp_path / "model.xml", art.error
    assert not (tmp_path / "model.onnx").exists()  # the IR replaces the .onnx file
    labels = _runs_like(model, art, captured)
    assert any(s.startswith("seq") for s in labels)
    # loaded from the file alone: the input names and output structure come from the IR
    again = OpenVinoModule(art.path)
    assert again.input_names == art.module.input_names and again.out_spec is not None
    ids = torch.randint(0, 50, (3, 7))  # another batch and another length
    with torch.no_grad():
        want = model(ids)
    got = again(ids)
    assert type(got) is type(want)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    (fresh,) = _fresh_core(art.path, ids)
    torch.testing.assert_close(fresh, want, atol=1e-4, rtol=1e-4)


def test_export_openvino_without_openvino_names_the_extra(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "openvino" else real(n, *a)
    )
    with pytest.raises(OpswapError, match=r"pip install 'opswap\[openvino\]'"):
        api.OptimizeConfig(export="openvino")
    model = torch.nn.Linear(4, 2).eval()
    with pytest.raises(ExportError, match=r"^Export to openvino needs openvino; install it"):
        api.export(model, (torch.randn(2, 4),), tmp_path / "plan.json", to="openvino", out=tmp_path)
    assert not list(tmp_path.iterdir())  # refused before the plan is read or a file written


def test_a_saved_ir_without_openvino_is_one_sentence(monkeypatch, tmp_path):
    (tmp_path / "model.xml").write_text("<net/>")
    monkeypatch.setitem(__import__("sys").modules, "openvino", None)  # import fails
    with pytest.raises(ExportError, match=r"needs openvino; install it with pip install"):
        opswap.load_optimized(tmp_path)


class _Dict(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 3), torch.nn.Linear(6, 2)

    def forward(self, x):
        return {"logits": self.a(x), "extra": (self.b(x), x.sum(-1))}


def test_an_ir_loaded_alone_returns_the_models_dict_and_tuples(tmp_path):
    model = _Dict().eval()
    x = torch.randn(4, 6)
    art = openvino_artifact(model, (x,), None, tmp_path, ir=True)
    assert art.module is not None, art.error
    again = opswap.load_optimized(tmp_path)  # model.xml alone: no program to read it from
    with torch.no_grad():
        want = model(x)
    got = again(x)
    assert set(got) == {"logits", "extra"} and isinstance(got["extra"], tuple)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
