import json

import onnx
from onnx import helper

from opswap.onnx.optimize import optimize_onnx, save


def test_optimize_verifies_races_and_saves_the_timed_file(exported, tmp_path):
    from opswap.onnx.load import load_onnx

    m = load_onnx(exported("vit"))
    result = optimize_onnx(m, model_type="vit", samples=1, min_time_s=0.05)
    paths = save(result, tmp_path / "out")
    data = json.loads(paths["result"].read_text())
    assert data["verification"]["passed"] and len(data["verification"]["shapes"]) == 3
    assert {v["name"] for v in data["variants"]} == {"input", "opswap", "ort-optimizer"}
    assert data["peer"]["fused"]["SkipLayerNormalization"] == 4
    assert data["best"] in ("opswap", "input") and data["benchmark"]["ref_ms"] > 0
    saved = onnx.load(str(paths["model"]))
    kinds = {n.op_type for n in saved.graph.node}
    assert ("MultiHeadAttention" in kinds) == (data["best"] == "opswap")
    assert "## Near misses" in paths["report_md"].read_text()


def test_a_failing_rewrite_is_not_saved(graphs, tmp_path, monkeypatch):
    """When verification fails, the input is what is saved, and the result says so."""
    import opswap.onnx.optimize as opt

    m = graphs.load([helper.make_node("Relu", ["x"], ["y"])], [("x", ["batch", 4])], ["y"])
    wrong = graphs.proto([helper.make_node("Sigmoid", ["x"], ["y"])], [("x", ["batch", 4])], ["y"])
    real = opt.plan_onnx
    monkeypatch.setattr(opt, "plan_onnx", lambda *a, **k: (real(*a, **k)[0], wrong))
    result = optimize_onnx(m, samples=1, min_time_s=0.02)
    assert not result.verification.passed and result.best == "input"
    assert [n.op_type for n in result.model.graph.node] == ["Relu"]
