"""BatchNorm -> GroupNorm or LayerNorm, for models that must normalise each sample on its
own, and a short distillation that recovers what the swap changed.

    student = opswap.train.norm_swap.prepare(model)                     # a copy; model unchanged
    opswap.train.norm_swap.distill(student, model, batches, steps=200)  # match model's outputs

Why: a BatchNorm normalises with the batch's statistics in training and with frozen
running statistics in eval. That breaks down at batch 1-2 (detection, segmentation,
federated or on-device fine-tuning), makes train and eval compute different functions,
and suits runtimes and sequence models where batch statistics are awkward. GroupNorm
(and LayerNorm, its one-group case) uses each sample's own statistics, in training and
in eval alike.

`prepare` replaces every nn.BatchNorm1d/2d/3d of a copy by an nn.GroupNorm over the same
channels: `to="group"` takes the largest divisor of C that is at most `groups` as the
group count; `to="layer"` takes one group over (C, *spatial), which is LayerNorm over a
sample's channels and positions (for a BatchNorm1d on [N, C] inputs, LayerNorm over the
features). The GroupNorm's affine starts as close to the BatchNorm's eval function as
the running statistics allow (rules/norm/_bn_groupnorm.py: each group's statistics taken
as the mixture of its channels'), which measured closer to the BatchNorm model's outputs
than copying gamma and beta, and than a least-squares fit on `calibration` batches
(`init="fit"`, layer after layer: each fit sees the inputs that the GroupNorms already
placed before it produce, and matches the original model's BatchNorm output there).
The swap still changes the function, since a sample's statistics are not the running
ones: `distill` then trains the copy to reproduce the original's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from opswap.errors import RuleError
from opswap.graph.capture import copy_module
from opswap.rules.norm._bn_groupnorm import (
    GROUPS,
    AffineFit,
    affine_init,
    group_count,
    scale_shift,
    stats_init,
)
from opswap.train._loop import args_of, train_steps

INITS = ("stats", "fit", "affine")
LOSSES = ("mse", "kl")


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _pairs(
    student: nn.Module, teacher: nn.Module, path: str, data: list[tuple[Any, ...]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input of the student's BatchNorm at `path`, output of the teacher's there), one
    pair per call, over every batch of `data`."""
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    h1 = student.get_submodule(path).register_forward_pre_hook(lambda m, a: xs.append(a[0]))
    h2 = teacher.get_submodule(path).register_forward_hook(lambda m, a, out: ys.append(out))
    try:
        with torch.no_grad():
            for args in data:
                student(*args)
                teacher(*args)
    finally:
        h1.remove()
        h2.remove()
    return list(zip(xs, ys, strict=True))


def _affine(
    bn: _BatchNorm, g: int, init: str, pairs: list[tuple[torch.Tensor, torch.Tensor]], path: str
) -> tuple[torch.Tensor, torch.Tensor]:
    c = bn.num_features
    naive = affine_init(bn.weight, bn.bias, c)
    if init == "affine" or bn.running_mean is None or bn.running_var is None:
        start = naive  # no running statistics: it always normalises with the batch's
    else:
        s, t = scale_shift(bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, c)
        start = stats_init(bn.running_mean, bn.running_var, s, t, g, bn.eps)
    if init != "fit":
        return start
    fit = AffineFit(c, g, bn.eps)
    for x, y in pairs:
        if x.numel() // (x.shape[0] * g) == 1:
            raise RuleError(
                f"BatchNorm {path} sees {list(x.shape)} inputs, so each of {g} groups "
                "would hold one value, which GroupNorm always maps to 0; use to='layer' "
                "or fewer groups."
            )
        fit.add(x, y)
    return fit.solve(start)


def prepare(
    model: nn.Module,
    to: str = "group",
    groups: int = GROUPS,
    *,
    calibration: Iterable[Any] | None = None,
    init: str | None = None,
) -> nn.Module:
    """A copy of `model`, in eval mode, with every BatchNorm replaced by a GroupNorm
    (`to="group"`: the largest divisor of C that is at most `groups`; `to="layer"`: one
    group, LayerNorm over channels and positions); `model` itself is not changed.

    The GroupNorm's affine starts from `init`: "stats" (from the running statistics, the
    default), "fit" (least squares on the `calibration` inputs, tensors or tuples of
    them) or "affine" (the BatchNorm's gamma and beta as they are)."""
    if to not in ("group", "layer"):
        raise RuleError(f"to must be 'group' or 'layer'; got {to!r}.")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise RuleError(f"groups must be a positive integer; got {groups!r}.")
    data = [args_of(b) for b in calibration] if calibration is not None else []
    if calibration is not None and not data:
        raise RuleError("prepare got an empty calibration; pass input batches, or None.")
    init = init or "stats"
    if init not in INITS:
        raise RuleError(f"init must be one of {', '.join(INITS)}; got {init!r}.")
    if init == "fit" and not data:
        raise RuleError("init='fit' fits on calibration inputs; pass calibration=batches.")
    out = copy_module(model).eval()
    paths = [p for p, m in out.named_modules() if isinstance(m, _BatchNorm)]
    if not paths:
        raise RuleError(f"{type(model).__name__} has no BatchNorm to replace.")
    teacher = copy_module(model).eval() if init == "fit" else None
    for path in paths:
        bn = out.get_submodule(path)
        assert isinstance(bn, _BatchNorm)
        c = bn.num_features
        g = 1 if to == "layer" else group_count(c, groups)
        pairs = _pairs(out, teacher, path, data) if teacher is not None else []
        a, b = _affine(bn, g, init, pairs, path)
        like = bn.weight if bn.weight is not None else bn.running_mean
        gn = nn.GroupNorm(
            g,
            c,
            eps=bn.eps,
            affine=True,
            dtype=like.dtype if like is not None else None,
            device=like.device if like is not None else None,
        )
        with torch.no_grad():
            gn.weight.copy_(a)
            gn.bias.copy_(b)
        _set(out, path, gn)
    return out


def _leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _describe(leaves: list[torch.Tensor]) -> str:
    return ", ".join(str(list(t.shape)) for t in leaves) or "no tensor"


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Any],
    *,
    steps: int = 100,
    lr: float = 1e-3,
    loss: str = "mse",
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Fine-tune `student` to reproduce `teacher`'s outputs on `batches` (inputs: tensors
    or tuples of them, cycled): Adam at `lr` for `steps` steps, the mean squared error of
    every floating output (`loss="mse"`) or the KL divergence of the teacher's softmax
    from the student's over the last dim (`loss="kl"`, for logits). The teacher runs on
    a frozen copy in eval mode and is never changed. Returns the loss of each step;
    `progress(step, loss)` is called after each."""
    if loss not in LOSSES:
        raise RuleError(f"loss must be one of {', '.join(LOSSES)}; got {loss!r}.")
    if student is teacher:
        raise RuleError("distill's student is the teacher itself; pass prepare(teacher).")
    data = [args_of(b) for b in batches]
    if not data:
        raise RuleError("distill got no batches; pass the input batches to distil on.")
    frozen = copy_module(teacher).eval().requires_grad_(False)
    with torch.no_grad():
        targets = [_leaves(frozen(*args)) for args in data]
        was = student.training
        got = _leaves(student.eval()(*data[0]))
        student.train(was)
    want = targets[0]
    if [t.shape for t in got] != [t.shape for t in want] or not any(
        t.is_floating_point() for t in want
    ):
        raise RuleError(
            f"distill needs outputs of the same shapes with a floating one: the student "
            f"returns {_describe(got)}, the teacher {_describe(want)}."
        )

    def step_loss(pair: tuple[tuple[Any, ...], list[torch.Tensor]]) -> torch.Tensor:
        args, target = pair
        terms = []
        for s, t in zip(_leaves(student(*args)), target, strict=True):
            if not t.is_floating_point():
                continue
            if loss == "kl":
                terms.append(
                    F.kl_div(
                        F.log_softmax(s, -1),
                        F.log_softmax(t, -1),
                        log_target=True,
                        reduction="batchmean",
                    )
                )
            else:
                terms.append(F.mse_loss(s, t))
        return torch.stack(terms).sum()

    pairs = list(zip(data, targets, strict=True))
    return train_steps(student, pairs, step_loss, steps=steps, lr=lr, progress=progress)
