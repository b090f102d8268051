"""The digits models: trained to >= 0.95 top-1, deterministically, cached; the committed
accuracy table (benchmarks/results/digits_accuracy.json) reproduced; accuracy in result.json
for a model with a task and not for one without; one sentence without scikit-learn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")

from opswap.config import OptimizeConfig  # noqa: E402
from opswap.errors import SpecError  # noqa: E402
from opswap.graph.calibrate import Calibration, attach  # noqa: E402
from opswap.graph.capture import capture  # noqa: E402
from opswap.models import load  # noqa: E402
from opswap.models import zoo_digits as zd  # noqa: E402
from opswap.pipeline import optimize  # noqa: E402
from opswap.planner import Plan, apply_plan  # noqa: E402

TABLE = Path(__file__).resolve().parents[2] / "benchmarks/results/digits_accuracy.json"
ROWS = json.loads(TABLE.read_text())["rows"]
POINT = 0.01  # the committed figures hold within a point of accuracy


@pytest.mark.parametrize("spec", ["zoo:digits_mlp", "zoo:digits_cnn"])
def test_trained_to_at_least_95_percent_with_a_task_and_calibration(spec):
    loaded = load(spec)
    task = loaded.task
    assert task is not None and task.metric == "top1"
    assert task.evaluate(loaded.module) >= 0.95
    batch = loaded.example_inputs[0].shape
    assert len(task.calibration) == 8
    assert all(c[0].shape == batch for c in task.calibration)
    # calibration comes from the training split, the example from the held-out one
    data = zd.digits(spec)
    first = task.calibration[0][0].reshape(batch[0], -1)
    assert all((data.train_x == row).all(dim=1).any() for row in first)
    assert torch.equal(loaded.example_inputs[0].reshape(batch[0], -1), data.test_x[: batch[0]])


def test_a_model_that_always_answers_one_class_scores_its_share():
    loaded = load("zoo:digits_mlp", {"batch": "7"})  # 360 rows: the last batch is padded
    ones = loaded.task.evaluate(
        lambda x: torch.nn.functional.one_hot(torch.full((x.shape[0],), 3), 10).float()
    )
    labels = zd.digits().test_y
    assert ones == pytest.approx(float((labels == 3).float().mean()))


def test_training_is_deterministic_in_a_fresh_cache(tmp_path, monkeypatch):
    data = zd.digits()
    recipe = zd.Recipe("mlp", seed=3, epochs=2)
    weights = []
    for run in ("a", "b"):
        monkeypatch.setenv("OPSWAP_CACHE", str(tmp_path / run))
        model = zd.trained(zd.DigitsMLP, recipe, data)
        weights.append(model.state_dict())
        assert len(list((tmp_path / run / "zoo").glob("digits_mlp-*.pt"))) == 1
    for key, value in weights[0].items():
        assert torch.equal(value, weights[1][key]), key
    # a third load reads the cache: same weights, and no training
    monkeypatch.setattr(zd, "_train", lambda *a: pytest.fail("trained again despite the cache"))
    again = zd.trained(zd.DigitsMLP, recipe, data)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in weights[0].items())


def test_an_unwritable_cache_trains_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("OPSWAP_CACHE", str(blocker))
    model = zd.trained(zd.DigitsMLP, zd.Recipe("mlp", seed=0, epochs=1), zd.digits())
    assert not model.training


def test_without_scikit_learn_loading_is_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn raises ImportError
    with pytest.raises(SpecError, match=r"zoo:digits_cnn .*pip install scikit-learn"):
        load("zoo:digits_cnn")


@pytest.mark.parametrize(
    "row", [r for r in ROWS if r["top1"] is not None], ids=lambda r: f"{r['model']}-{r['scheme']}"
)
def test_the_committed_accuracy_table_is_reproduced(row):
    loaded = load(row["model"])
    if row["scheme"] == "float32":
        fn = loaded.module
    else:
        captured = capture(loaded.module, loaded.example_inputs)
        attach(captured.gm, Calibration(list(loaded.task.calibration)))  # as the table was
        plan = Plan.from_json(row["plan"])
        assert len(plan.decisions) == row["sites"]
        fn = apply_plan(captured, plan).gm
    assert abs(loaded.task.evaluate(fn) - row["top1"]) <= POINT


def test_result_json_carries_accuracy_for_a_model_with_a_task(tmp_path):
    from opswap.api import optimize_loaded

    config = OptimizeConfig(
        rules="precision.*",
        exactness="approx",
        bench=False,
        layers=False,
        samples=1,
        dynamic="none",  # the saved model takes batches of 32 only: the task pads the last
    )
    result = optimize_loaded(load("zoo:digits_mlp"), config)
    data = result.to_json()["accuracy"]
    assert data["metric"] == "top1" and data["reference"] >= 0.95
    assert abs(data["candidate"] - data["reference"]) <= POINT
    result.save(tmp_path)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["accuracy"] == data
    assert "Accuracy (top1)" in (tmp_path / "report.md").read_text()


def test_result_json_has_no_accuracy_for_a_model_without_a_task():
    loaded = load("zoo:resnet", {"batch": "1", "image_size": "32"})
    assert loaded.task is None
    config = OptimizeConfig(
        rules="precision.*", exactness="approx", bench=False, layers=False, samples=1
    )
    result = optimize(loaded.module, loaded.example_inputs, config, task=None)
    assert result.accuracy is None and result.to_json()["accuracy"] is None
