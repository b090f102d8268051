"""The memory format an op's output takes, decided the same way by its real kernels and its
fake kernel, so that torch.compile and torch.export, which plan buffers from the fake
kernel's strides, find the strides the real kernel returns (Inductor asserts them).

The decision reads only the strides of dims longer than 1. A size-1 dim's stride addresses
nothing: Inductor lays it out as it likes and compares strides without it, opcheck too.
ATen's own `suggest_memory_format` does read it (an [N, 1, H, W] tensor with stride 1 on
its channel dim is "channels-last", with stride H*W "contiguous", the same memory), so an
op whose output followed ATen there changed layout when Inductor restated a size-1 stride
between tracing and running it. Here such a tensor, which reads both ways, settles nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: innermost dim first: the dims in the order of increasing stride each format lays out
_ORDERS: dict[torch.memory_format, dict[int, tuple[int, ...]]] = {
    torch.contiguous_format: {n: tuple(range(n - 1, -1, -1)) for n in range(1, 9)},
    torch.channels_last: {4: (1, 3, 2, 0)},
    torch.channels_last_3d: {5: (1, 4, 3, 2, 0)},
}
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def strides(shape: Sequence[Any], fmt: torch.memory_format) -> list[Any]:
    """The strides `torch.empty(shape, memory_format=fmt)` gives (sizes may be SymInts)."""
    out: list[Any] = [0] * len(shape)
    step: Any = 1
    for d in _ORDERS[fmt][len(shape)] if shape else ():
        out[d] = step
        size = shape[d]  # sym_max costs 3 us a call, a plain max 0.1: ints take max
        step = step * (max(size, 1) if isinstance(size, int) else torch.sym_max(size, 1))
    return out


def _laid_out(t: torch.Tensor, fmt: torch.memory_format) -> bool:
    """Whether t's strides grow in fmt's order over its dims longer than 1."""
    order = _ORDERS[fmt].get(t.dim())
    if order is None:
        return False
    last: Any = 0
    for d in order:
        if t.shape[d] == 1:
            continue
        if t.stride(d) < last:
            return False
        last = t.stride(d)
    return True


def channels_last_of(t: torch.Tensor) -> torch.memory_format | None:
    """channels_last (channels_last_3d) when a 4-D (5-D) t is laid out so over its dims
    longer than 1 and not also as NCHW; None otherwise, a tensor that reads both ways
    included."""
    fmt = _CHANNELS_LAST.get(t.dim())
    if fmt is None or t.is_contiguous():  # is_contiguous: laid out as NCHW, the common case
        return None
    if t.is_contiguous(memory_format=fmt):  # dense: then not NCHW too, as it is not contiguous
        return fmt
    if not _laid_out(t, fmt) or _laid_out(t, torch.contiguous_format):
        return None
    return fmt


def in_format(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """t with the strides of its size-1 dims restated as fmt's when its other dims are laid
    out so (a view, no copy), so that an ATen kernel handed t reads it as fmt."""
    if (
        t.dim() not in _ORDERS[fmt]
        or not _has_size_one(t)
        or not t.is_contiguous(memory_format=fmt)
    ):
        return t  # without a size-1 (or empty) dim, fmt's strides are the only ones it can have
    want = strides(t.shape, fmt)
    return t if list(t.stride()) == want else t.as_strided(t.shape, want)


def as_promised(y: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """A kernel's output y in fmt with exactly the strides `strides(y.shape, fmt)` (what the
    fake kernel gives), copying only when y's dims longer than 1 are laid out otherwise."""
    if not y.is_contiguous(memory_format=fmt):
        y = y.contiguous(memory_format=fmt)
    if not _has_size_one(y):
        return y
    want = strides(y.shape, fmt)
    return y if list(y.stride()) == want else y.as_strided(y.shape, want)


def _has_size_one(t: torch.Tensor) -> bool:
    return any(s <= 1 for s in t.shape)


def empty_as_promised(y: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """For a fake kernel: an empty tensor of y's size, dtype and device in fmt's strides."""
    return y.new_empty_strided(y.shape, strides(y.shape, fmt))
