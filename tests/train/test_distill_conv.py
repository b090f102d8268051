"""opswap.train.distill_conv on scikit-learn's digits: decomposing the zoo CNN's convs
(CP rank 4, depthwise-separable) costs accuracy, layer-wise distillation recovers part of
it and fine-tuning brings it within 3 points of the original; a 5x5 conv of a CNN trained
here becomes stacked 3x3s within 3 points, before and after fine-tuning; the model given
is never changed; an error bound picks the rank; bad input is refused in a sentence."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opswap.errors import RuleError
from opswap.models.zoo_digits import digits, digits_cnn
from opswap.train import distill_conv as dc

#: fine-tuned accuracy must come within this of the original model's (held-out top-1)
MARGIN = 0.03


@pytest.fixture(scope="module")
def task():
    torch.manual_seed(0)
    model, _, task = digits_cnn()
    data = digits()
    x, y = data.train_x.view(-1, 1, 8, 8), data.train_y
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    labelled = [(x[order[i : i + 64]], y[order[i : i + 64]]) for i in range(0, len(y), 64)]
    return model, task, labelled


@pytest.mark.parametrize(("method", "rank"), [("cp", 4), ("depthwise", 1)])
def test_fine_tuning_recovers_the_accuracy(task, method, rank, one_torch_thread):
    model, t, labelled = task
    before = copy.deepcopy(model.state_dict())
    reference = t.evaluate(model)
    student, done = dc.decompose(model, method, t.calibration[:2], rank=rank)
    assert [r.path for r in done] == ["features.1.0", "features.2.0"]  # the first reads 1 channel
    assert all(r.macs_after < 0.5 * r.macs_before and r.output_error > 0.3 for r in done)
    replaced = t.evaluate(student)
    dc.distill(student, model, t.calibration[:2], [r.path for r in done], steps=30, lr=3e-3)
    distilled = t.evaluate(student)
    dc.fine_tune(student, labelled, steps=60)
    tuned = t.evaluate(student)
    assert replaced < reference - 0.1 and distilled > replaced + 0.1  # the loss; distillation
    assert tuned >= reference - MARGIN, (reference, replaced, distilled, tuned)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class CNN5(nn.Module):
    """A digits CNN with a 5x5 conv in the middle (16 -> 16 channels at 8x8)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 5, padding=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.f(x).flatten(1))


def test_a_5x5_conv_becomes_stacked_3x3s_within_the_margin(task, one_torch_thread):
    _, t, labelled = task
    torch.manual_seed(0)
    model = CNN5()
    dc.fine_tune(model, labelled, steps=150, lr=3e-3)
    reference = t.evaluate(model)
    assert reference > 0.9
    student, done = dc.decompose(model, "stacked", t.calibration[:2])
    assert [(r.path, r.rank) for r in done] == [("f.2", 16)]
    assert [type(m).__name__ for m in student.f[2]] == ["Conv2d", "Conv2d"]
    assert t.evaluate(student) >= reference - MARGIN
    dc.fine_tune(student, labelled, steps=40)
    assert t.evaluate(student) >= reference - MARGIN


def test_an_error_bound_picks_the_rank(task):
    model, t, _ = task
    _, done = dc.decompose(model, "channel", t.calibration[:1], max_error=0.2)
    for r in done:
        assert r.weight_error <= 0.2
    _, tight = dc.decompose(model, "channel", t.calibration[:1], max_error=0.05)
    assert all(a.rank <= b.rank for a, b in zip(done, tight, strict=True))


def test_bad_input_is_refused_in_a_sentence(task):
    model, t, labelled = task
    cal = t.calibration[:1]
    with pytest.raises(RuleError, match="method must be one of"):
        dc.decompose(model, "tucker", cal)
    with pytest.raises(RuleError, match="rank must be a positive integer"):
        dc.decompose(model, "cp", cal, rank=0)
    with pytest.raises(RuleError, match="no batches"):
        dc.decompose(model, "cp", [])
    with pytest.raises(RuleError, match="not an nn.Conv2d"):
        dc.decompose(model, "cp", cal, paths=["head"])
    with pytest.raises(RuleError, match="kernel is 3x3"):
        dc.decompose(model, "stacked", cal, paths=["features.1.0"])
    with pytest.raises(RuleError, match="no submodule"):
        dc.decompose(model, "cp", cal, paths=["nope"])
    with pytest.raises(RuleError, match="teacher itself"):
        dc.distill(model, model, cal, ["features.1.0"])
    with pytest.raises(RuleError, match="not an \\(inputs, labels\\) pair"):
        dc.fine_tune(copy.deepcopy(model), [labelled[0][0]])
