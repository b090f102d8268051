"""Training losses built on opswap's fused kernels.

    loss = opswap.train.losses.linear_cross_entropy(hidden, lm_head.weight, labels)
    loss.backward()

is `F.cross_entropy(F.linear(hidden, weight, bias), labels, ...)` without the logits: the
vocabulary's logits are made and consumed a chunk of rows at a time
(`opswap::linear_cross_entropy`, kernels/linear_cross_entropy.py), so the [tokens, vocab]
tensor and its gradient are never held in full. It works in eager mode and under
`torch.compile(fullgraph=True)`. `LinearCrossEntropy` wraps a model's lm_head module.

Differences from PyTorch's loss, on purpose: the loss is float32 whatever the inputs'
dtype; a "mean" over rows that are all `ignore_index` is 0 with zero gradients (PyTorch's
is NaN).
"""

from __future__ import annotations

import torch
from torch import nn

from opswap.errors import OpswapError
from opswap.kernels import linear_cross_entropy as _lce

__all__ = ["LinearCrossEntropy", "LossError", "linear_cross_entropy"]


class LossError(OpswapError, ValueError):
    """A loss was called with inputs or settings it cannot take."""


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _validate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise LossError(f"{name} must be a tensor, not {type(t).__name__}.")
    if hidden.dim() < 1 or hidden.dtype not in _FLOATS:
        raise LossError(
            f"hidden must be a floating-point tensor [..., H], not {hidden.dtype} of shape "
            f"{list(hidden.shape)}."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise LossError(
            f"weight must be [vocab, {hidden.shape[-1]}] to match hidden's last dim, "
            f"not {list(weight.shape)}."
        )
    if weight.shape[0] == 0:
        raise LossError("weight has no rows: the vocabulary is empty.")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        got = f"{weight.dtype}" + ("" if bias is None else f" and bias {bias.dtype}")
        raise LossError(f"hidden is {hidden.dtype} but weight {got}: cast them to one dtype.")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise LossError(
            f"bias must be [{weight.shape[0]}] (one per class), not {list(bias.shape)}."
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise LossError(f"target must hold class indices (an integer tensor), not {target.dtype}.")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise LossError(
            f"target {list(target.shape)} must have hidden's leading dims "
            f"{list(hidden.shape[:-1])} (one class index per row)."
        )
    devices = {t.device for t in (hidden, weight, target, bias) if t is not None}
    if len(devices) > 1:
        raise LossError(f"hidden, weight, target and bias are on {sorted(map(str, devices))}.")
    if reduction not in _lce.REDUCTIONS:
        raise LossError(
            f"reduction must be one of {', '.join(_lce.REDUCTIONS)}, not {reduction!r}."
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise LossError(f"label_smoothing must be in [0, 1], not {label_smoothing}.")
    if softcap is not None and not softcap > 0:
        raise LossError(f"softcap must be a positive number or None, not {softcap}.")
    if not torch.compiler.is_compiling() and target.numel():
        # a data-dependent check: eager only (under compile it would break the graph)
        v = weight.shape[0]
        bad = (target != ignore_index) & ((target < 0) | (target >= v))
        if bool(bad.any()):
            first = int(target[bad].reshape(-1)[0])
            raise LossError(
                f"target holds class {first}, outside [0, {v}) for a vocabulary of {v} "
                f"(and not ignore_index {ignore_index})."
            )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
) -> torch.Tensor:
    """The cross-entropy of `hidden @ weight.T + bias` (softcapped to cap * tanh(x / cap)
    when `softcap` is given) against `target`, without materialising the logits.

    hidden [..., H]; weight [V, H] (an lm_head's weight); target [...] class indices, rows
    equal to `ignore_index` not counted; bias [V] or None. Returns a float32 scalar, or a
    float32 tensor of target's shape for reduction="none"."""
    _validate(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap)
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1).long()
    leaves = (hidden, weight) if bias is None else (hidden, weight, bias)
    with_grad = torch.is_grad_enabled() and any(x.requires_grad for x in leaves)
    loss = _lce.linear_cross_entropy(
        h,
        weight,
        t,
        bias,
        int(ignore_index),
        float(label_smoothing),
        reduction,
        None if softcap is None else float(softcap),
        with_grad,
    )[0]
    return loss.reshape(target.shape) if reduction == "none" else loss


class LinearCrossEntropy(nn.Module):
    """A language model's head and its loss in one: `LinearCrossEntropy(model.lm_head)(h,
    labels)` is `F.cross_entropy(model.lm_head(h), labels)` (with the settings given here)
    without the logits. The head's parameters are shared, not copied: training updates
    the model's own lm_head."""

    def __init__(
        self,
        lm_head: nn.Linear,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(lm_head, nn.Linear):
            raise LossError(
                f"LinearCrossEntropy wraps an nn.Linear head, not {type(lm_head).__name__}."
            )
        if reduction not in _lce.REDUCTIONS:
            raise LossError(
                f"reduction must be one of {', '.join(_lce.REDUCTIONS)}, not {reduction!r}."
            )
        self.lm_head = lm_head
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            self.lm_head.weight,
            target,
            self.lm_head.bias,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
            softcap=self.softcap,
        )

    def extra_repr(self) -> str:
        cap = "" if self.softcap is None else f", softcap={self.softcap}"
        return (
            f"vocab={self.lm_head.out_features}, hidden={self.lm_head.in_features}, "
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
            f"reduction={self.reduction!r}{cap}"
        )
