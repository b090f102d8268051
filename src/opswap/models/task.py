"""A task a model may come with: a held-out split to score it on, and calibration inputs.

Error against the float model (cosine, relative L2) says how far a quantised model moved;
a task says what that costs: `evaluate(fn)` runs any callable that takes the model's
positional inputs (the module, a reloaded model.pt2, a compiled function) over the
held-out split and returns the metric. `calibration` holds input tuples from the training
split, for schemes that fix their scales from sample activations (static quantisation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from opswap.errors import VerificationError


@dataclass(frozen=True)
class Task:
    """A metric over a held-out split (`evaluate(fn) -> float`) and calibration inputs."""

    metric: str  # e.g. "top1": the fraction of held-out samples classified right
    evaluate: Callable[[Callable[..., Any]], float]
    calibration: list[tuple[torch.Tensor, ...]]
    description: str  # what the metric is measured on, in words: "the 360 held-out images"


@dataclass(frozen=True)
class Accuracy:
    """A task's metric for the float model (`reference`) and for the model a run saved."""

    metric: str
    reference: float
    candidate: float
    description: str = ""

    @property
    def drop(self) -> float:
        """How much the saved model lost, in the metric's units (negative: it gained)."""
        return self.reference - self.candidate

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "reference": self.reference,
            "candidate": self.candidate,
            "description": self.description,
        }


def top1_accuracy(
    fn: Callable[..., Any], inputs: torch.Tensor, labels: torch.Tensor, batch: int
) -> float:
    """The fraction of `inputs` whose largest logit under `fn` is the label, run in batches
    of exactly `batch` rows: the last batch is padded with rows from the start (and their
    answers dropped), so that a model saved for one batch size takes every call."""
    n = len(labels)
    right = 0
    with torch.inference_mode():
        for start in range(0, n, batch):
            rows = torch.arange(start, start + batch) % n
            logits = _logits(fn(inputs[rows]))
            take = min(batch, n - start)
            right += int((logits[:take].argmax(dim=-1).cpu() == labels[start : start + take]).sum())
    return right / n


def _logits(out: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or the first of a tuple or list."""
    while isinstance(out, Sequence) and not isinstance(out, torch.Tensor):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise VerificationError(
            f"The model returned {type(out).__name__}; a top-1 task scores a tensor of logits "
            "(or a tuple whose first item is one), so return the logits from forward."
        )
    return out.float()
