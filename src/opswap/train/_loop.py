"""The short fine-tuning loop that opswap.train.qat.fine_tune and opswap.train.norm_swap.distill share:
Adam over a model's trainable parameters for a fixed number of steps, cycling the data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def args_of(inputs: Any) -> tuple[Any, ...]:
    """A batch's inputs as positional arguments: a tuple as it is, anything else alone."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


def train_steps(
    model: nn.Module,
    data: list[Any],
    step_loss: Callable[[Any], torch.Tensor],
    *,
    steps: int,
    lr: float,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """`steps` steps of Adam at `lr` on `model` (put in train mode), the loss of step i
    being `step_loss(data[i % len(data)])`; returns each step's loss, and calls
    `progress(step, loss)` after each. `data` must not be empty."""
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = step_loss(data[step % len(data)])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    return losses
