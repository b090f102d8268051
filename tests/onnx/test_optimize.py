import json

import onnx
import pytest
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


def _gelu(graphs):
    """x * 0.5 * (1 + erf(x / sqrt 2)): one onnx.gelu site."""
    nodes = [
        graphs.const("r", 2**0.5),
        graphs.const("one", 1.0),
        graphs.const("half", 0.5),
        helper.make_node("Div", ["x", "r"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["x", "half"], ["m"]),
        helper.make_node("Mul", ["m", "a"], ["y"]),
    ]
    return graphs.load(nodes, [("x", ["batch", "seq", 8])], ["y"])


def test_an_old_opset_detector_is_converted_sized_and_raced_without_the_transformer_peer(
    tmp_path,
):
    """A convolutional detector at opset 12 with symbolic batch, height and width: converted,
    given sizes it runs at, not raced against ORT's transformer optimizer, and with no rule
    applied, the file as given is what is saved, with report.html."""
    from tests.onnx.conftest import detector

    from opswap.onnx.load import load_onnx

    m = load_onnx(detector(tmp_path / "det.onnx", opset=12))
    result = optimize_onnx(m, samples=1, min_time_s=0.05)
    paths = save(result, tmp_path / "out")
    data = json.loads(paths["result"].read_text())
    assert data["sizes"] == {"batch": 2, "height": 224, "width": 224}
    assert data["verification"]["passed"] and len(data["verification"]["shapes"]) == 3
    assert {v["name"] for v in data["variants"]} == {"input", "opswap"} and not data["peer"]
    assert data["best"] == "input" and not data["applied"]
    notes = " ".join(data["notes"])
    assert "converted to opset 13" in notes and "224x224" in notes
    assert "transformer optimizer was not raced: it has no attention and no LayerNorm" in notes
    assert "no rule applied; the input is saved" in notes
    assert onnx.load(str(paths["model"])).opset_import[0].version == 12  # the file as given
    html = paths["report_html"].read_text()
    assert "not raced" in html and "<table>" in html


def _fake_race(opswap_over_input: float, jitter: float):
    """A BenchResult of 30 rounds where opswap takes `opswap_over_input` times the input's
    time, each round off by up to `jitter` of it."""
    import numpy as np

    from opswap.bench.stats import BenchResult, Stats

    rng = np.random.default_rng(3)
    rounds = []
    for _ in range(30):
        base = 1e-3 * (1 + jitter * rng.uniform(-1, 1))
        rounds.append(
            {"input": base, "opswap": base * opswap_over_input * (1 + jitter * rng.uniform(-1, 1))}
        )
    stats = {n: Stats(n, [r[n] for r in rounds], 1) for n in ("input", "opswap")}
    return BenchResult(stats, rounds, [["input", "opswap"]] * 30, "cpu", 0)


@pytest.mark.parametrize(
    ("ratio", "jitter", "saved"),
    [
        (1 / 0.96, 0.3, "input"),
        (1 / 0.8, 0.02, "input"),
        (1 / 1.02, 0.4, "input"),
        (0.5, 0.02, "opswap"),
    ],
)
def test_opswap_is_saved_only_when_faster_than_the_input_beyond_noise(
    graphs, monkeypatch, ratio, jitter, saved
):
    """The PyTorch race's rule: 0.96x or 1.02x within the noise and 0.80x keep the input;
    2x beyond the noise saves opswap's file."""
    import opswap.onnx.optimize as opt

    m = _gelu(graphs)
    monkeypatch.setattr(opt, "time_models", lambda *a, **k: _fake_race(ratio, jitter))
    result = optimize_onnx(m, samples=1)
    assert result.plan.counts() == {"onnx.gelu": 1} and result.verification.passed
    assert result.best == saved
    kinds = {n.op_type for n in result.model.graph.node}
    assert ("Gelu" in kinds) == (saved == "opswap")
    if saved == "input":
        assert any("not faster than the input beyond the run's noise" in n for n in result.notes)


@pytest.mark.parametrize("how", ["raises", "unloadable"])
def test_a_failing_peer_is_named_in_the_report_and_the_run_still_writes_it(
    graphs, tmp_path, monkeypatch, how
):
    import opswap.onnx.optimize as opt

    m = _gelu(graphs)
    if how == "raises":

        def peer(proto, kind):
            raise RuntimeError("Cannot parse data from external tensors\nsecond line")

    else:
        broken = graphs.proto(
            [helper.make_node("NoSuchOp", ["x"], ["y"])], [("x", ["batch", "seq", 8])], ["y"]
        )

        def peer(proto, kind):
            return broken, {"Gelu": 0}

    monkeypatch.setattr(opt, "ort_optimize", peer)
    result = optimize_onnx(m, samples=1, min_time_s=0.02, model_type="bert")
    paths = save(result, tmp_path / "out")
    assert {v["name"] for v in result.variants} == {"input", "opswap"}
    for name in ("report_md", "report_html"):
        text = paths[name].read_text()
        assert "transformer optimizer (model_type=bert)" in text
        if how == "raises":
            assert (
                "failed on this model" in text and "Cannot parse data from external tensors" in text
            )
        else:
            assert "could not be checked" in text or "does not load" in text
