"""Fine-tuning after a lossy embedding rewrite (chapter 18: embedding.hashed,
embedding.pruned): train the rewritten model toward the original's outputs on sample
inputs (distillation by mean squared error), and measure how often the two agree.

    before = agreement(original, rewritten, inputs)
    fine_tune(rewritten, original, inputs, steps=200)
    after = agreement(original, rewritten, inputs)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.train._loop import train_steps


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def fine_tune(
    model: nn.Module,
    teacher: nn.Module,
    inputs: Sequence[tuple[torch.Tensor, ...]],
    *,
    steps: int = 200,
    lr: float = 1e-2,
) -> list[float]:
    """Train `model` in place so that its output matches `teacher`'s on `inputs` (each a
    tuple of arguments); returns the losses and leaves the model in eval mode."""
    data = list(inputs)
    if not data:
        raise RuleError("fine_tune got no sample inputs; pass tuples of the model's arguments.")
    with torch.no_grad():
        targets = [_first(teacher(*x)).detach() for x in data]
    pairs = list(zip(data, targets, strict=True))

    def loss(pair: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> torch.Tensor:
        x, y = pair
        return F.mse_loss(_first(model(*x)), y)

    with torch.enable_grad():
        losses = train_steps(model, pairs, loss, steps=steps, lr=lr)
    model.eval()
    return losses


def agreement(
    reference: nn.Module, candidate: nn.Module, inputs: Sequence[tuple[torch.Tensor, ...]]
) -> float:
    """The share of rows whose top-1 class (argmax of the last dim) the two agree on."""
    same = total = 0
    with torch.no_grad():
        for x in inputs:
            a, b = _first(reference(*x)).argmax(-1), _first(candidate(*x)).argmax(-1)
            same += int((a == b).sum())
            total += a.numel()
    return same / max(total, 1)
