"""Fine-tuning a pruned or sparse model with its sparsity kept, and what sparsity costs in
accuracy on the digits task (chapter 7).

    masks = semi_structured_masks(model)               # 2:4 on every Linear/conv that takes it
    apply_masks(model, masks); fine_tune_masked(model, batches, masks)
    curve = accuracy_curve(model, example, task)       # ratios 0, 0.25, 0.5, 0.75
    write_curve(curve, "out/")                         # sparsity_curve.png, .md, .json

A mask is a boolean tensor per weight (by parameter name); `fine_tune_masked` trains with
Adam and writes the zeros back after every step, so momentum cannot regrow a pruned weight.
A structurally pruned model (opswap.train.prune) needs no mask: its channels are gone.

`accuracy_curve` measures, for each ratio, top-1 of the model pruned three ways (channels
with opswap.train.prune, single weights by magnitude, and 2:4 at its fixed 50%) before and
after a short fine-tune on the digits training split; `write_curve` draws it into a folder
(next to report.html when the folder is a run's output) with the table beside it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.models.task import Task
from opswap.rules.sparsity._masks import magnitude_mask, mask_2_4
from opswap.train._loop import train_steps
from opswap.train.finetune_pooling import digits_batches
from opswap.train.prune import count_params, prune

Masks = dict[str, torch.Tensor]
METHODS = ("structured", "unstructured", "2:4")


def _weights(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The weights of the Linears and convolutions, by parameter name."""
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd)):
            yield (f"{path}.weight" if path else "weight"), mod.weight


def semi_structured_masks(model: nn.Module) -> Masks:
    """A 2:4 mask for every Linear and conv whose inputs per output (in x kernel) are a
    multiple of 4; the others are left dense."""
    out = {}
    for name, w in _weights(model):
        flat = w.detach().reshape(w.shape[0], -1)
        if flat.shape[1] % 4 == 0:
            out[name] = mask_2_4(flat).view_as(w)
    return out


def unstructured_masks(model: nn.Module, sparsity: float) -> Masks:
    """Each Linear and conv weight pruned to `sparsity` by magnitude, layer by layer."""
    out = {}
    for name, w in _weights(model):
        out[name] = magnitude_mask(w.detach().reshape(w.shape[0], -1), sparsity).view_as(w)
    return out


def apply_masks(model: nn.Module, masks: Masks) -> None:
    """Zero the weights `masks` drop, in place."""
    params = dict(model.named_parameters())
    missing = sorted(set(masks) - set(params))
    if missing:
        raise RuleError(f"the masks name {missing[0]}, which the model has no parameter of.")
    with torch.no_grad():
        for name, mask in masks.items():
            params[name].mul_(mask.to(params[name].device, params[name].dtype))


def sparsity_of(model: nn.Module, masks: Masks) -> float:
    """The share of the masked weights that are zero."""
    total = sum(m.numel() for m in masks.values())
    return 1.0 - sum(int(m.sum()) for m in masks.values()) / total if total else 0.0


def fine_tune_masked(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    masks: Masks | None = None,
    *,
    epochs: float = 1.0,
    lr: float = 1e-3,
) -> list[float]:
    """Train `model` in place with cross-entropy on (inputs, labels) `batches` for `epochs`
    passes, the weights `masks` drop kept at zero after every step; leaves it in eval mode
    and returns each step's loss."""
    data = list(batches)
    if not data:
        raise RuleError("fine_tune_masked got no batches; pass (inputs, labels) pairs.")
    if epochs <= 0:
        raise RuleError(f"fine_tune_masked needs a positive number of epochs, got {epochs}.")
    masks = masks or {}
    apply_masks(model, masks)

    def step_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    def keep_zeros(step: int, loss: float) -> None:
        apply_masks(model, masks)

    steps = max(1, round(epochs * len(data)))
    with torch.enable_grad():
        losses = train_steps(model, data, step_loss, steps=steps, lr=lr, progress=keep_zeros)
    model.eval()
    return losses


@dataclass(frozen=True)
class CurvePoint:
    """One pruned model: how, at what ratio, the share of weights it dropped (removed or
    zero), its parameters, and top-1 before and after fine-tuning."""

    method: str
    ratio: float
    sparsity: float
    params: int
    accuracy: float
    fine_tuned: float | None  # None: not fine-tuned (a task holds no labels to train on)


@dataclass
class SparsityCurve:
    """Accuracy against sparsity for one model and task."""

    model: str
    metric: str
    reference: float
    epochs: float
    points: list[CurvePoint] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "metric": self.metric,
            "reference": self.reference,
            "epochs": self.epochs,
            "points": [asdict(p) for p in self.points],
        }

    def table(self) -> str:
        """The points as a Markdown table."""
        lines = [
            f"Accuracy ({self.metric}) against sparsity for {self.model}: {self.reference:.4f} "
            f"unpruned; "
            + (
                f"fine-tuned {self.epochs:g} epoch(s) with the sparsity kept."
                if self.epochs
                else "not fine-tuned."
            ),
            "",
            "| method | ratio | weights dropped | parameters | accuracy | fine-tuned |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in self.points:
            lines.append(
                f"| {p.method} | {p.ratio:g} | {100 * p.sparsity:.1f}% | {p.params} | "
                f"{p.accuracy:.4f} | "
                + ("-" if p.fine_tuned is None else f"{p.fine_tuned:.4f}")
                + " |"
            )
        return "\n".join(lines) + "\n"


def accuracy_curve(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    task: Task,
    *,
    ratios: Sequence[float] = (0.0, 0.25, 0.5, 0.75),
    methods: Sequence[str] = METHODS,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    epochs: float = 1.0,
    lr: float = 1e-3,
    seed: int = 0,
) -> SparsityCurve:
    """Top-1 of `model` pruned at each ratio by each method (2:4 once, at 50%), before and
    after `epochs` of masked fine-tuning on `batches` (default: the digits training split,
    shaped like the example). The user's model is not changed."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise RuleError(f"unknown sparsity method {unknown[0]!r}; use {', '.join(METHODS)}.")
    if batches is None:
        batches = digits_batches(seed=seed, shape=tuple(example_inputs[0].shape[1:]))
    base = copy.deepcopy(model).eval()
    n_weights = sum(w.numel() for _, w in _weights(base))
    curve = SparsityCurve(type(model).__name__, task.metric, task.evaluate(base), epochs)
    for method in methods:
        for ratio in (0.5,) if method == "2:4" else ratios:
            torch.manual_seed(seed)
            masks: Masks = {}
            if method == "structured":
                work = prune(base, example_inputs, ratio).model.eval()
                kept = sum(w.numel() for _, w in _weights(work))
                dropped = 1.0 - kept / n_weights
            else:
                work = copy.deepcopy(base)
                masks = (
                    semi_structured_masks(work)
                    if method == "2:4"
                    else unstructured_masks(work, ratio)
                )
                apply_masks(work, masks)
                dropped = (
                    sparsity_of(work, masks) * sum(m.numel() for m in masks.values()) / n_weights
                )
            before = task.evaluate(work)
            if ratio > 0:
                fine_tune_masked(work, batches, masks, epochs=epochs, lr=lr)
            point = CurvePoint(
                method, ratio, dropped, count_params(work), before, task.evaluate(work)
            )
            curve.points.append(point)
    return curve


def plot_curve(curve: SparsityCurve) -> bytes:
    """The curve as a PNG: accuracy against the share of weights dropped, one colour per
    method, dashed as pruned and solid after fine-tuning."""
    from opswap.report.plots import sparsity_curve

    title = f"Accuracy against sparsity: {curve.model}"
    return sparsity_curve([asdict(p) for p in curve.points], curve.reference, curve.metric, title)


def write_curve(curve: SparsityCurve, out: str | Path) -> dict[str, Path]:
    """sparsity_curve.png, sparsity_curve.md (the table, the plot linked) and
    sparsity_curve.json into folder `out`."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "png": folder / "sparsity_curve.png",
        "md": folder / "sparsity_curve.md",
        "json": folder / "sparsity_curve.json",
    }
    paths["png"].write_bytes(plot_curve(curve))
    paths["md"].write_text(
        "# Accuracy against sparsity\n\n![accuracy against sparsity](sparsity_curve.png)\n\n"
        + curve.table()
    )
    paths["json"].write_text(json.dumps(curve.to_json(), indent=2) + "\n")
    return paths


#: the sparsities task_curve measures for unstructured pruning
TASK_RATIOS = (0.0, 0.5, 0.75, 0.9, 0.95)


def task_curve(
    model: nn.Module,
    task: Task,
    rules: Iterable[str],
    *,
    device: str = "cpu",
    ratios: Sequence[float] = TASK_RATIOS,
) -> SparsityCurve:
    """`task`'s metric for `model` with its Linear weights made sparse the way the
    sparsity `rules` that ran do (2:4 for sparsity.semi_structured; magnitude at each of
    `ratios` for sparsity.unstructured), not fine-tuned: what `opswap optimize --exactness
    lossy` reports beside the accuracy of the model it saved. The model is not changed."""
    base = copy.deepcopy(model).eval()
    total = sum(w.numel() for w in _linear_weights(base).values())

    def score(work: nn.Module) -> float:
        with torch.no_grad():
            return task.evaluate(lambda *xs: work(*(x.to(device) for x in xs)))

    curve = SparsityCurve(type(model).__name__, task.metric, score(base), 0.0)
    names = set(rules)
    if "sparsity.semi_structured" in names:
        work = copy.deepcopy(base)
        masks = {n: mask_2_4(w) for n, w in _linear_weights(work).items() if w.shape[-1] % 4 == 0}
        apply_masks(work, masks)
        dropped = sparsity_of(work, masks) * sum(m.numel() for m in masks.values()) / max(total, 1)
        curve.points.append(CurvePoint("2:4", 0.5, dropped, count_params(work), score(work), None))
    if "sparsity.unstructured" in names:
        for ratio in ratios:
            work = copy.deepcopy(base)
            masks = {n: magnitude_mask(w, ratio) for n, w in _linear_weights(work).items()}
            apply_masks(work, masks)
            curve.points.append(
                CurvePoint("unstructured", ratio, ratio, count_params(work), score(work), None)
            )
    return curve


def _linear_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        (f"{p}.weight" if p else "weight"): m.weight.detach()
        for p, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
