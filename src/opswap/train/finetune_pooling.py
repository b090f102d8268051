"""Fine-tuning after a lossy pooling rewrite (chapter 13), and what it costs on the digits task.

    model, example, task = digits_pool_net()                      # trained, with its task
    report = lossy_accuracy(model, example, task, "pooling.max_to_avg")
    report.reference, report.replaced, report.fine_tuned          # top-1 before/after/tuned

MaxPool -> AvgPool, AvgPool -> a strided depthwise conv (once trained) and flatten +
Linear -> global average pooling change the function a network computes; how much it
loses, and how much a short fine-tuning wins back, is measured on scikit-learn's digits
(opswap.models.zoo_digits: 1437 training images, 360 held out). `fine_tune` trains any
module (the user's, or the GraphModule a plan produced) with cross-entropy on labelled
batches; `digits_batches` gives the training split as such batches; `lossy_accuracy`
runs the whole comparison for one rule.

`digits_pool_net` is the small CNN these rules are shown on: conv 1->16, ReLU, MaxPool 2
(8x8 -> 4x4), conv 16->32, ReLU, AvgPool 2 (-> 2x2), flatten, Linear 128 -> 10: one site
for each lossy pooling rule. It trains once (a few seconds, cached like the zoo's).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.models.task import Task
from opswap.models.zoo_digits import Recipe, _example, _task, digits, trained
from opswap.train._loop import train_steps

SHAPE = (1, 8, 8)


class DigitsPoolNet(nn.Module):
    """A digits CNN with a max pool, an average pool and a flatten + Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool2 = nn.AvgPool2d(2)
        self.head = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 1, 8, 8]
        h = self.pool1(F.relu(self.conv1(x)))
        h = self.pool2(F.relu(self.conv2(h)))
        return self.head(torch.flatten(h, 1))


def digits_pool_net(
    batch: int = 32, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, ...], Task]:
    """DigitsPoolNet trained on the digits task (cached), a held-out batch as its example
    input, and the task (top-1 on the 360 held-out images)."""
    if batch < 1:
        raise RuleError(f"digits_pool_net needs a batch of at least 1, got {batch}.")
    data = digits("the pooling digits net")
    model = trained(DigitsPoolNet, Recipe("cnn", seed, lr=4e-3), data)
    return model, _example(data, SHAPE, batch), _task(data, SHAPE, batch, seed)


def digits_batches(
    batch: int = 64, seed: int = 0, shape: Sequence[int] = SHAPE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled pass over the digits training split as (images, labels) batches, the
    images viewed as `shape` (1, 8, 8 for a CNN; 64 for an MLP)."""
    if batch < 1:
        raise RuleError(f"digits_batches needs a batch of at least 1, got {batch}.")
    data = digits("the digits fine-tuning data")
    order = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(seed))
    out = []
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        out.append((data.train_x[rows].view(-1, *shape), data.train_y[rows]))
    return out


def fine_tune(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    epochs: float = 2.0,
    lr: float = 1e-3,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train `model` in place with cross-entropy on (inputs, labels) `batches` for `epochs`
    passes (Adam at `lr`); returns each step's loss and leaves the model in eval mode."""
    data = list(batches)
    if not data:
        raise RuleError("fine_tune got no batches; pass (inputs, labels) pairs to train on.")
    if epochs <= 0:
        raise RuleError(f"fine_tune needs a positive number of epochs, got {epochs}.")
    if not any(p.requires_grad for p in model.parameters()):
        raise RuleError(
            f"{type(model).__name__} has no trainable parameters; nothing to fine-tune."
        )
    steps = max(1, round(epochs * len(data)))

    def step_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    with torch.enable_grad():
        losses = train_steps(model, data, step_loss, steps=steps, lr=lr, progress=progress)
    model.eval()
    return losses


@dataclass(frozen=True)
class LossyAccuracy:
    """Top-1 of the original, of the rewritten model as the rule leaves it, and of the
    rewritten model after fine-tuning; `sites`: how many places the rule rewrote."""

    rule: str
    reference: float
    replaced: float
    fine_tuned: float
    sites: int
    epochs: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def lossy_accuracy(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    task: Task,
    rule: str,
    *,
    epochs: float = 2.0,
    lr: float = 1e-3,
    seed: int = 0,
) -> LossyAccuracy:
    """Apply `rule` (at --exactness lossy) to a capture of `model`, and measure top-1 of
    the original, of the rewritten model, and of a copy of it fine-tuned for `epochs` on
    the digits training split; the user's model is not changed."""
    from opswap.graph.capture import capture
    from opswap.planner import apply_plan, make_plan

    captured = capture(model, example_inputs)
    plan = make_plan(captured, rules=[rule], exactness="lossy", keep_slower=True)
    sites = sum(d.rule == rule for d in plan.decisions)
    if sites == 0:
        why = "; ".join(m.reason for m in plan.misses if m.rule == rule) or "no site matched"
        raise RuleError(f"{rule} found nothing to rewrite in {type(model).__name__}: {why}.")
    applied = apply_plan(captured, plan)
    replaced = applied.gm.eval()
    tuned = copy.deepcopy(replaced)
    shape = tuple(example_inputs[0].shape[1:])
    fine_tune(tuned, digits_batches(seed=seed, shape=shape), epochs=epochs, lr=lr)
    return LossyAccuracy(
        rule,
        task.evaluate(model),
        task.evaluate(replaced),
        task.evaluate(tuned),
        sites,
        epochs,
    )
