"""opswap.train.finetune_sparse: masks are what they say (2:4, magnitude), fine-tuning
keeps the zeros, and on the digits CNN the curve shows pruning costs accuracy that a
short fine-tune wins back; the plot and table are written; the model is never changed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opswap.errors import RuleError
from opswap.models.zoo_digits import digits_cnn
from opswap.rules.sparsity._masks import is_2_4
from opswap.train import finetune_sparse as fs
from opswap.train.finetune_pooling import digits_batches


def test_2_4_masks_only_where_inputs_split_into_fours() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3), nn.Flatten(), nn.Linear(8, 5))
    masks = fs.semi_structured_masks(model)
    assert sorted(masks) == [
        "1.weight",
        "3.weight",
    ]  # 1 x 3 x 3 = 9 inputs: not 2:4; 4 x 3 x 3 = 36 are
    fs.apply_masks(model, masks)
    assert is_2_4(model[1].weight.detach().reshape(8, -1)) and is_2_4(model[3].weight.detach())
    assert fs.sparsity_of(model, masks) == pytest.approx(0.5)


def test_unstructured_masks_and_fine_tuning_keep_the_zeros(one_torch_thread: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 3))
    masks = fs.unstructured_masks(model, 0.9)
    assert int(masks["0.weight"].sum()) == 24 and int(masks["2.weight"].sum()) == 6
    data = [(torch.randn(16, 12), torch.randint(0, 3, (16,))) for _ in range(4)]
    losses = fs.fine_tune_masked(model, data, masks, epochs=3)
    assert len(losses) == 12 and losses[-1] < losses[0]
    for name, w in model.named_parameters():
        if name in masks:
            assert torch.all(w[~masks[name]] == 0) and torch.any(w[masks[name]] != 0)
    assert not model.training


def test_bad_input_is_one_sentence() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(RuleError, match="no parameter of"):
        fs.apply_masks(model, {"other.weight": torch.ones(2, 4, dtype=torch.bool)})
    with pytest.raises(RuleError, match="got no batches"):
        fs.fine_tune_masked(model, [])
    with pytest.raises(RuleError, match="unknown sparsity method"):
        fs.accuracy_curve(model, (torch.randn(1, 4),), None, methods=("random",))  # type: ignore[arg-type]


def test_the_digits_curve_and_its_files(tmp_path, one_torch_thread: None) -> None:
    model, example, task = digits_cnn()
    before = copy.deepcopy(model.state_dict())
    batches = digits_batches(batch=128, shape=(1, 8, 8))
    curve = fs.accuracy_curve(model, example, task, ratios=(0.0, 0.5), batches=batches)
    by = {(p.method, p.ratio): p for p in curve.points}
    assert set(by) == {("structured", 0.0), ("structured", 0.5), ("unstructured", 0.0),
                       ("unstructured", 0.5), ("2:4", 0.5)}  # fmt: skip
    assert by[("structured", 0.0)].accuracy == curve.reference > 0.95
    s = by[("structured", 0.5)]
    assert s.params < by[("structured", 0.0)].params and s.sparsity > 0.5
    assert s.accuracy < curve.reference - 0.05 and s.fine_tuned > s.accuracy + 0.05
    assert by[("unstructured", 0.5)].sparsity == pytest.approx(0.5, abs=0.01)
    assert by[("2:4", 0.5)].fine_tuned > curve.reference - 0.03
    paths = fs.write_curve(curve, tmp_path / "run")
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert "| structured | 0.5 |" in paths["md"].read_text()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_optimize_reports_accuracy_against_sparsity_where_a_sparsity_rule_ran() -> None:
    from types import SimpleNamespace

    from opswap import api
    from opswap.models.zoo_digits import digits_mlp
    from opswap.report.document import to_markdown
    from opswap.report.optimize_report import _sparsity

    model, _, task = digits_mlp()
    result = SimpleNamespace(applied=[SimpleNamespace(rule="fusion.silu")], sparsity=None)
    api._sparsity_curve(result, model, task, "cpu")  # type: ignore[arg-type]
    assert result.sparsity is None  # no sparsity rule ran: no curve
    result.applied.append(SimpleNamespace(rule="sparsity.unstructured"))
    result.applied.append(SimpleNamespace(rule="sparsity.semi_structured"))
    api._sparsity_curve(result, model, task, "cpu")  # type: ignore[arg-type]
    curve = result.sparsity
    assert curve is not None and curve["metric"] == "top1"
    points = {(p["method"], p["ratio"]): p["accuracy"] for p in curve["points"]}
    assert set(points) == {("2:4", 0.5)} | {("unstructured", r) for r in fs.TASK_RATIOS}
    assert points[("unstructured", 0.0)] == curve["reference"] > 0.95
    assert (
        points[("unstructured", 0.95)] < points[("unstructured", 0.5)] <= curve["reference"] + 0.01
    )
    md, files = to_markdown(_sparsity(curve))
    assert "| unstructured | 90.0% |" in md and files["sparsity_curve.png"][:4] == b"\x89PNG"
