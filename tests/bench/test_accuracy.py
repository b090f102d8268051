"""Every variant's row carries its accuracy: the metric its verdict turned on, with its
value and budget, top-1 agreement where outputs are class scores, the task's metric
where the run has a task."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.bench.accuracy import judged_by
from opswap.models.task import Task, top1_accuracy
from opswap.pipeline import OptimizeConfig, optimize
from opswap.report.candidates import accuracy_cell
from opswap.verify.decisions import traced
from opswap.verify.outputs import verify


class _Scaled(nn.Module):
    def __init__(self, inner: nn.Module, by: float):
        super().__init__()
        self.inner, self.by = inner, by

    def forward(self, x):
        return self.inner(x) * self.by


def _regression():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 1)).eval()


def test_a_failing_check_names_the_metric_it_broke():
    m = _regression()
    check = verify(m, _Scaled(m, 1.01), (torch.randn(5, 7),), samples=2, tolerance="exact")
    acc = judged_by(check)
    assert acc["passed"] is False and acc["reason"] == check.reasons[0]
    # 1% off: rel_l2 0.01 is 1000x its 1e-5 bound, the largest share of any budget
    assert acc["metric"] == "rel_l2" and acc["budget"] == "rel_l2<=1e-05"
    assert acc["value"] == pytest.approx(0.01, rel=1e-3) and acc["budget_used"] > 100
    assert accuracy_cell(acc).startswith("failed: rel_l2 0.01 (budget rel_l2<=1e-05)")


def test_a_passing_check_names_the_bound_it_came_nearest_to():
    m = _regression()
    check = verify(m, _Scaled(m, 1.001), (torch.randn(6, 7),), samples=2, tolerance="approx")
    acc = judged_by(check)
    assert acc["passed"] is True and acc["reason"] is None
    assert acc["metric"] == "rel_l2" and acc["budget"] == "rel_l2<=0.03"
    assert 0 < acc["budget_used"] < 1 and acc["samples"] == 2
    assert acc["top1_agreement"] is None  # one regression output: no class scores


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x))


def test_class_scores_carry_top1_agreement():
    torch.manual_seed(0)
    m = Classifier().eval()
    x = (torch.randn(8, 6),)
    check = verify(m, _Scaled(m, 1.0005), x, samples=2, tolerance="approx", graph=traced(m))
    acc = judged_by(check)
    assert acc["passed"] and acc["top1_agreement"] == 1.0 and acc["decision_rows"] >= 16
    assert f"top-1 100% of {acc['decision_rows']} rows" in accuracy_cell(acc)


def test_every_row_of_an_optimize_run_carries_its_accuracy_and_the_tasks():
    torch.manual_seed(0)
    m = Classifier().eval()
    xs, ys = torch.randn(40, 6), torch.randint(0, 4, (40,))
    task = Task("top1", lambda fn: top1_accuracy(fn, xs, ys, 10), [(xs[:10],)], "40 rows")
    r = optimize(
        m,
        (torch.randn(5, 6),),
        OptimizeConfig(samples=2, layers=False, measure_rules=False, compare="none"),
        task=task,
    )
    rows = {v["name"]: v for v in r.to_json()["variants"]}
    assert set(rows) == {"input", "captured", "opswap"}
    assert rows["input"]["accuracy"]["reference"] is True
    for name in ("captured", "opswap"):
        acc = rows[name]["accuracy"]
        assert acc["passed"] is True and acc["metric"] and acc["budget"]
        assert acc["top1_agreement"] == 1.0 and acc["shapes"]  # verified at other batches too
    reference = r.accuracy.reference
    for row in rows.values():  # the task's metric on each variant: the same model, exactly
        assert row["accuracy"]["task"] == {"metric": "top1", "value": pytest.approx(reference)}
    assert "task top1" in accuracy_cell(rows["opswap"]["accuracy"])


def test_the_cell_reads_a_top1_verdict_and_an_identical_row_in_words():
    top1 = {"passed": False, "metric": "top1", "value": 0.9727, "budget": "top1>=0.99",
            "decision_rows": 1100, "max_abs": 0.3, "top1_agreement": 0.9727, "task": None}  # fmt: skip
    assert accuracy_cell(top1) == "failed: 97.27% of 1100 rows the same top-1 (budget top1>=0.99)"
    same = {"passed": True, "metric": "cosine", "value": 1.0, "budget": "cosine>=0.999",
            "max_abs": 0.0, "task": {"metric": "top1", "value": 0.98889}}  # fmt: skip
    assert accuracy_cell(same) == "the same outputs (max_abs 0); task top1 0.9889"
    broken = {"passed": False, "metric": None, "reason": "the candidate raised ValueError",
              "task": {"metric": "top1", "error": "ValueError: batch"}}  # fmt: skip
    assert accuracy_cell(broken) == (
        "failed: the candidate raised ValueError; task top1: not measured (ValueError: batch)"
    )
    assert accuracy_cell(None) == "-"
