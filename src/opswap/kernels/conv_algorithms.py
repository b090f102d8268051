"""The convolution algorithms a conv site can be run with, besides PyTorch's own conv.

Chapter 11's algorithms (Winograd, FFT, im2col + GEMM) compute the same convolution by a
different route; which one is fastest depends on the layer's shape, the dtype and the
machine, so the rule `conv.algorithm` races them per site. Each algorithm lives in its own
kernel module (kernels/conv_winograd.py, kernels/conv_fft.py, ...) beside its reference,
registers its torch op, and declares one `ConvAlgorithm` with `register`; no list here
names them. `algorithms()` imports every public module of opswap.kernels once, so the
registry is complete wherever it is read.

A `ConvSite` is what an algorithm is judged on: the shapes of the call at the example and
the conv's static settings. An algorithm's `refuses(site)` says, in the user's words, why
it cannot run a site ("stride 2: Winograd F(2x2,3x3) needs stride 1"), or None; the rule
then inserts `op(x, weight, bias, *extra(site))` in place of the conv.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from opswap.errors import OpswapError


class ConvAlgorithmError(OpswapError, ValueError):
    """A convolution algorithm registered twice, or asked for by a name that does not exist."""


@dataclass(frozen=True)
class ConvSite:
    """One convolution call: its input and weight shapes at the example, its settings."""

    input_shape: tuple[int, ...]  # (N, C, *spatial)
    weight_shape: tuple[int, ...]  # (O, C // groups, *kernel)
    stride: tuple[int, ...]
    padding: tuple[int, ...]  # zero padding, the same on both sides of each spatial dim
    dilation: tuple[int, ...]
    groups: int
    dtype: torch.dtype
    device: str  # "cpu" or "cuda"
    # the input arrives in channels-last (a 2-D conv in a channels-last model): the race
    # times every candidate on such an input, so one that computes in channels-last pays
    # no conversion there
    channels_last: bool = False

    @property
    def dims(self) -> int:
        """Spatial dims: 1 for conv1d, 2 for conv2d."""
        return len(self.weight_shape) - 2

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(self.weight_shape[2:])

    @property
    def output_spatial(self) -> tuple[int, ...]:
        """The output's spatial sizes, by PyTorch's formula."""
        return tuple(
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, k, s, p, d in zip(
                self.input_shape[2:],
                self.kernel,
                self.stride,
                self.padding,
                self.dilation,
                strict=True,
            )
        )

    def settings(self) -> tuple[list[int], list[int], list[int], int]:
        """The conv's own settings as an algorithm op takes them after (x, weight, bias):
        stride, padding, dilation, groups (never the example's sizes)."""
        return list(self.stride), list(self.padding), list(self.dilation), self.groups

    def direct_multiplications(self) -> int:
        """Multiplications of the direct convolution: N x O x output pixels x C/g x kernel."""
        n, o, c_per_group = self.input_shape[0], self.weight_shape[0], self.weight_shape[1]
        return n * o * math.prod(self.output_spatial) * c_per_group * math.prod(self.kernel)


@dataclass(frozen=True)
class ConvAlgorithm:
    """One way to compute a convolution, as its kernel module declares it."""

    name: str  # "winograd_f2x2_3x3", "fft", "im2col", ...
    op: Any  # the registered torch op (an OpOverload, e.g. torch.ops.opswap.conv_fft.default)
    exactness: Literal["exact", "approx"]  # im2col is exact (rounding only); Winograd, FFT approx
    refuses: Callable[[ConvSite], str | None]
    extra: Callable[[ConvSite], tuple[Any, ...]]  # the op's arguments after (x, weight, bias)
    multiplications: Callable[[ConvSite], int]
    chapter: int = 11
    description: str = ""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, site: ConvSite
    ) -> torch.Tensor:
        return self.op(x, weight, bias, *self.extra(site))  # type: ignore[no-any-return]


_REGISTRY: dict[str, ConvAlgorithm] = {}
_LOADED = False


def register(algorithm: ConvAlgorithm) -> ConvAlgorithm:
    """Add `algorithm` to the registry (at its kernel module's import); a second
    registration under the same name by another object is an error."""
    known = _REGISTRY.get(algorithm.name)
    if known is not None and known is not algorithm and known.op is not algorithm.op:
        raise ConvAlgorithmError(
            f"convolution algorithm {algorithm.name!r} is registered twice; give the new one "
            "another name"
        )
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    here = Path(__file__)
    for m in sorted(pkgutil.iter_modules([str(here.parent)]), key=lambda m: m.name):
        if m.name.startswith("conv_") and m.name != here.stem:
            importlib.import_module(f"{__package__}.{m.name}")
    _LOADED = True


def algorithms() -> tuple[ConvAlgorithm, ...]:
    """Every registered algorithm, in name order."""
    _load()
    return tuple(_REGISTRY[name] for name in sorted(_REGISTRY))


def get(name: str) -> ConvAlgorithm:
    """The algorithm called `name`; an unknown name is refused in one sentence."""
    _load()
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ConvAlgorithmError(
            f"there is no convolution algorithm called {name!r}; known: {known}"
        )
    return _REGISTRY[name]


def check_call(op: str, x: torch.Tensor, weight: torch.Tensor, groups: int) -> None:
    """Refuse, in one sentence naming `op`, a call whose input and weight are not one
    conv1d or conv2d split into `groups`."""
    if weight.dim() not in (3, 4) or x.dim() != weight.dim():
        raise ValueError(
            f"{op} takes a conv1d or conv2d: input of {x.dim()} dims and weight of "
            f"{weight.dim()} dims are not one"
        )
    if x.shape[1] != weight.shape[1] * groups:
        raise ValueError(
            f"{op}: the input has {x.shape[1]} channels, the weight expects "
            f"{weight.shape[1]} x {groups} groups"
        )
    if weight.shape[0] % groups:
        raise ValueError(
            f"{op}: {weight.shape[0]} output channels do not split into {groups} groups"
        )


def check_cpu_float32_conv2d(op: str, x: torch.Tensor, weight: torch.Tensor, groups: int) -> None:
    """check_call, then refuse in one sentence what a CPU float32 conv2d op (oneDNN's
    prepacked conv, NNPACK) cannot take."""
    check_call(op, x, weight, groups)
    if weight.dim() != 4:
        raise ValueError(f"{op} runs conv2d only; call it with a 4-D input and weight")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"{op} runs float32; the input is {x.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"{op} runs on the CPU; the input is on {x.device.type}")


def cpu_float32_conv2d_refusal(site: ConvSite, what: str) -> str | None:
    """Why `what` (a CPU float32 conv2d algorithm) cannot take `site`, or None."""
    if site.dims != 2:
        return f"{what} runs conv2d; this is a {site.dims}-D convolution"
    if site.dtype != torch.float32:
        return f"{what} is raced in float32; this site is {site.dtype}"
    if site.device != "cpu":
        return f"{what} runs on the CPU"
    return None


def site_of(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: tuple[int, ...] | list[int],
    padding: tuple[int, ...] | list[int],
    dilation: tuple[int, ...] | list[int],
    groups: int,
) -> ConvSite:
    """The ConvSite of a call with these tensors and settings."""
    return ConvSite(
        input_shape=tuple(x.shape),
        weight_shape=tuple(weight.shape),
        stride=tuple(stride),
        padding=tuple(padding),
        dilation=tuple(dilation),
        groups=groups,
        dtype=x.dtype,
        device=x.device.type,
    )
