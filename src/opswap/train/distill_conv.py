"""Decompose a model's convolutions on purpose, then train the loss back: the user-side
companion of the lossy rules conv.low_rank, conv.cp, conv.depthwise_separable and
conv.stacked_3x3 (chapter 11).

    student, report = opswap.train.distill_conv.decompose(model, "cp", batches, rank=16)
    opswap.train.distill_conv.distill(student, model, batches, steps=100)  # layer by layer
    opswap.train.distill_conv.fine_tune(student, labelled, steps=300)      # on the task

The rules choose the rank that keeps a conv within the lossy verification's error, and
so refuse most trained convs for the CP and depthwise-separable forms; here the user
names the method and the rank (or an error bound), takes the loss, and trains it back:

- `decompose` returns a copy of the model with each chosen nn.Conv2d replaced by an
  nn.Sequential of the convs the method fits from its weight (rules/conv/_decompose.py),
  and per layer the weight's and the output's relative error on the sample batches and
  the multiply-adds and weights before and after;
- `distill` fits each replaced chain to the original conv's outputs, on the original's
  inputs at that layer (every layer at once, each on its own target: no error carried
  from one layer into the next's data);
- `fine_tune` trains the whole model on labelled batches (cross-entropy by default).

Both trainings use the loop opswap.train.norm_swap and opswap.train.qat share
(train._loop), and leave the model in eval mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.graph.capture import copy_module
from opswap.rules.conv._decompose import (
    METHODS,
    Decomposition,
    Layer,
    channel_rank,
    fit,
    layer_of,
    output_error,
    smallest,
    spatial_rank,
    stacked_count,
)
from opswap.train._loop import args_of, train_steps


@dataclass(frozen=True)
class Replaced:
    """What `decompose` did to one conv."""

    path: str
    method: str
    rank: int
    weight_error: float
    output_error: float
    macs_before: int
    macs_after: int
    params_before: int
    params_after: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _conv_inputs(
    model: nn.Module, paths: Sequence[str], data: list[tuple[Any, ...]]
) -> dict[str, torch.Tensor]:
    """Each conv's inputs over every batch of `data`, concatenated (float64, CPU)."""
    got: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    hooks = [
        model.get_submodule(p).register_forward_pre_hook(
            lambda m, a, p=p: got[p].append(a[0].detach().double().cpu())
        )
        for p in paths
    ]
    try:
        with torch.no_grad():
            for args in data:
                model(*args)
    finally:
        for h in hooks:
            h.remove()
    return {p: torch.cat(v) for p, v in got.items() if v}


def _choose(
    conv: Layer, method: str, rank: int | None, max_error: float, x: torch.Tensor
) -> Decomposition:
    if rank is not None:
        return fit(conv, method, rank, x)
    o, c = conv.out_channels, conv.in_channels
    kh, kw = conv.kernel_size
    if method == "channel":
        return fit(conv, method, channel_rank(conv, max_error))
    if method == "spatial":
        return fit(conv, method, spatial_rank(conv, max_error))
    if method == "stacked":
        return fit(conv, method, max(c, o), x)
    top = {
        "cp": min(o * c * kh, o * c * kw, o * kh * kw, c * kh * kw),
        "depthwise": min(o, kh * kw),
    }
    found = smallest(conv, method, max_error, top[method])
    return found if found is not None else fit(conv, method, top[method])


def _eligible(path: str, mod: nn.Module, method: str) -> str | None:
    """Why the conv at `path` is not decomposed by `method` (None: it is)."""
    if not isinstance(mod, nn.Conv2d):
        return f"{path} is a {type(mod).__name__}, not an nn.Conv2d"
    if mod.groups != 1 and method != "stacked":
        return f"{path} has groups={mod.groups}; the {method} method takes ungrouped convs"
    if method == "stacked":
        n = stacked_count(layer_of(mod))
        if isinstance(n, str):
            return f"{path}: {n}"
    if method in ("cp", "depthwise") and tuple(mod.kernel_size) == (1, 1):
        return f"{path} is a 1x1 conv, which has no spatial part to separate"
    if mod.in_channels == 1 and method in ("cp", "depthwise", "channel"):
        return f"{path} reads one channel, so there is nothing to split"
    return None


def decompose(
    model: nn.Module,
    method: str,
    batches: Iterable[Any],
    *,
    rank: int | None = None,
    max_error: float = 0.1,
    paths: Sequence[str] | None = None,
) -> tuple[nn.Module, list[Replaced]]:
    """A copy of `model` (eval mode; `model` is not changed) with its nn.Conv2d layers
    decomposed by `method` ("channel", "spatial", "cp", "depthwise", "stacked"): the ones
    named in `paths`, else every one the method can take. `rank` is the rank (the depth
    multiplier for "depthwise", the middle width for "stacked"); without it, the smallest
    whose kernel errs at most `max_error` (relative L2). `batches` (inputs: tensors or
    tuples) give the convs' input sizes, the output errors and the stacked fit's data.
    Returns the copy and what was done to each conv."""
    if method not in METHODS:
        raise RuleError(f"method must be one of {', '.join(METHODS)}; got {method!r}.")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise RuleError(f"rank must be a positive integer or None; got {rank!r}.")
    if not 0 < max_error < 1:
        raise RuleError(f"max_error must lie in (0, 1); got {max_error!r}.")
    data = [args_of(b) for b in batches]
    if not data:
        raise RuleError("decompose got no batches; pass a few input batches of the model.")
    out = copy_module(model).eval()
    convs = dict(out.named_modules())
    if paths is None:
        chosen = [p for p, m in convs.items() if _eligible(p, m, method) is None]
        if not chosen:
            raise RuleError(
                f"{type(model).__name__} has no nn.Conv2d the {method} method can take."
            )
    else:
        chosen = list(paths)
        for p in chosen:
            if p not in convs:
                raise RuleError(f"{type(model).__name__} has no submodule {p!r}.")
            why = _eligible(p, convs[p], method)
            if why:
                raise RuleError(f"{why}.")
    inputs = _conv_inputs(out, chosen, data)
    done = []
    for p in chosen:
        mod = out.get_submodule(p)
        assert isinstance(mod, nn.Conv2d)
        conv = layer_of(mod)
        x = inputs[p]
        dec = _choose(conv, method, rank, max_error, x)
        h, w = int(x.shape[2]), int(x.shape[3])
        done.append(
            Replaced(
                p,
                method,
                dec.rank,
                dec.weight_error,
                output_error(conv, dec, x),
                conv.macs(h, w),
                dec.macs(h, w),
                conv.params(),
                dec.params(),
            )
        )
        _set(out, p, dec.module(mod.weight.dtype, mod.weight.device))
    return out.eval(), done


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Any],
    paths: Sequence[str],
    *,
    steps: int = 100,
    lr: float = 1e-3,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Fit the student's modules at `paths` (the chains `decompose` installed) to the
    teacher's convs there: Adam on the mean squared error of their outputs, each chain on
    the teacher's inputs at its layer, for `steps` steps cycling `batches` (inputs). Only
    those modules train. Returns each step's loss (summed over the layers, each relative
    to its target's mean square)."""
    if student is teacher:
        raise RuleError("distill's student is the teacher itself; pass decompose(teacher, ...)[0].")
    if not paths:
        raise RuleError("distill got no paths; pass the paths decompose replaced.")
    data = [args_of(b) for b in batches]
    if not data:
        raise RuleError("distill got no batches; pass the input batches to distil on.")
    frozen = copy_module(teacher).eval().requires_grad_(False)
    pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for args in data:
        xs = _conv_inputs(frozen, paths, [args])
        with torch.no_grad():
            pairs.append(
                [(xs[p], frozen.get_submodule(p)(xs[p].to(_dtype(frozen, p)))) for p in paths]
            )
    chains = [student.get_submodule(p) for p in paths]
    was = [m.requires_grad for m in student.parameters()]
    student.requires_grad_(False)
    for chain in chains:
        chain.requires_grad_(True)

    def step_loss(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        terms = []
        for chain, (x, y) in zip(chains, batch, strict=True):
            got = chain(x.to(y.dtype))
            terms.append(F.mse_loss(got, y) / y.pow(2).mean().clamp_min(1e-12))
        return torch.stack(terms).sum()

    try:
        return train_steps(student, pairs, step_loss, steps=steps, lr=lr, progress=progress)
    finally:
        for p, flag in zip(student.parameters(), was, strict=True):
            p.requires_grad_(flag)
        student.eval()


def _dtype(model: nn.Module, path: str) -> torch.dtype:
    return next(model.get_submodule(path).parameters()).dtype


def fine_tune(
    model: nn.Module,
    batches: Iterable[tuple[Any, torch.Tensor]],
    *,
    steps: int = 200,
    lr: float = 1e-3,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train every parameter of `model` on labelled `batches` ((inputs, labels) pairs,
    cycled) for `steps` steps of Adam at `lr`, minimising `loss(model(inputs), labels)`
    (cross-entropy by default). Returns each step's loss; the model ends in eval mode."""
    data = list(batches)
    if not data:
        raise RuleError("fine_tune got no batches; pass (inputs, labels) pairs.")
    for i, b in enumerate(data):
        if not isinstance(b, (tuple, list)) or len(b) != 2:
            raise RuleError(f"fine_tune's batch {i} is not an (inputs, labels) pair.")

    def step_loss(batch: tuple[Any, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return loss(model(*args_of(x)), y)

    try:
        return train_steps(model, data, step_loss, steps=steps, lr=lr, progress=progress)
    finally:
        model.eval()
