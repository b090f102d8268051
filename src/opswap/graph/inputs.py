"""The user's input tensors are left alone too: every run opswap makes gets its own copy.

A forward may write into its inputs (`x.mul_(2)`, `mask.masked_fill_(...)`). Handed
the caller's tensors, opswap's dozens of runs (capture, size probes, verification,
the race) would each scale them again: the user's example came back 32x larger, and
the race timed on `inf`. So the stages copy the inputs before each run of a model
that writes into them (`fresh`), and `writes` finds out, from the tensors' version
counters, whether a model does, so that timing loops copy only where they must (the
copy then costs every variant alike, and the notes say so).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree


def fresh(inputs: tuple) -> tuple:
    """A copy of `inputs` whose tensors are new (same values, dtype, device and strides);
    everything else as it is."""

    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.layout != torch.strided:
            return x.clone()
        out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        return out.copy_(x.detach()).requires_grad_(x.requires_grad)

    return tuple(pytree.tree_map(copy, list(inputs)))


def writes(run: Callable[[tuple], object], inputs: tuple) -> list[int]:
    """The positions (among the input tensors, pytree order) that `run` writes into, found
    by running it once on a fresh copy of `inputs` and reading the version counters."""
    with torch.inference_mode(False):  # inference tensors keep no version counter
        xs = fresh(inputs)
    tensors = [x for x in pytree.tree_leaves(list(xs)) if isinstance(x, torch.Tensor)]
    before = [x._version for x in tensors]
    run(xs)
    return [i for i, (x, v) in enumerate(zip(tensors, before, strict=True)) if x._version != v]


def caller(fn: Callable, inputs: tuple, copy: bool) -> Callable[[], object]:
    """`fn(*inputs)` as a call without arguments, for timing loops; with `copy`, each call
    runs on a fresh copy of the inputs (for a model that writes into them)."""
    if copy:
        return lambda: fn(*fresh(inputs))
    return lambda: fn(*inputs)
