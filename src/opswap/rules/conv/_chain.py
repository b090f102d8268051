"""A chain of 2-D convolutions standing for one: its layers, the kernel they compose to,
their cost; the vocabulary of rules/conv/_decompose.py and its fits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError

Pair = tuple[int, int]


@dataclass(frozen=True)
class Layer:
    """One conv of a chain (or the original): weight [out, in/groups, kh, kw]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    groups: int = 1

    @property
    def out_channels(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_channels(self) -> int:
        return int(self.weight.shape[1]) * self.groups

    @property
    def kernel_size(self) -> Pair:
        return int(self.weight.shape[2]), int(self.weight.shape[3])

    def out_size(self, h: int, w: int) -> Pair:
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        (ph, pw), (dh, dw) = self.padding, self.dilation
        return (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (
            w + 2 * pw - dw * (kw - 1) - 1
        ) // sw + 1

    def macs(self, h: int, w: int) -> int:
        """Multiply-adds on an [*, in, h, w] input."""
        oh, ow = self.out_size(h, w)
        return int(self.weight[0].numel()) * self.out_channels * max(oh, 0) * max(ow, 0)

    def params(self) -> int:
        return int(self.weight.numel()) + (0 if self.bias is None else int(self.bias.numel()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def module(self, dtype: torch.dtype, device: torch.device | None = None) -> nn.Conv2d:
        conv = nn.Conv2d(
            self.in_channels,
            self.out_channels,
            self.kernel_size,  # type: ignore[arg-type]
            stride=self.stride,  # type: ignore[arg-type]
            padding=self.padding,  # type: ignore[arg-type]
            dilation=self.dilation,  # type: ignore[arg-type]
            groups=self.groups,
            bias=self.bias is not None,
            device=device,
            dtype=dtype,
        )
        with torch.no_grad():
            conv.weight.copy_(self.weight)
            if self.bias is not None and conv.bias is not None:
                conv.bias.copy_(self.bias)
        return conv


@dataclass(frozen=True)
class Decomposition:
    """A chain of convs standing for one conv, and how far it is from it."""

    method: str
    rank: int
    layers: tuple[Layer, ...]
    weight_error: float

    def kernel(self) -> torch.Tensor:
        """The dense kernel [O, C, kh, kw] the chain computes (dilation aside)."""
        return composed(self.layers)

    def macs(self, h: int, w: int) -> int:
        total = 0
        for layer in self.layers:
            total += layer.macs(h, w)
            h, w = layer.out_size(h, w)
        return total

    def params(self) -> int:
        return sum(layer.params() for layer in self.layers)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def module(self, dtype: torch.dtype, device: torch.device | None = None) -> nn.Sequential:
        return nn.Sequential(*(layer.module(dtype, device) for layer in self.layers))

    def describe(self) -> str:
        shapes = " -> ".join(
            f"{layer.kernel_size[0]}x{layer.kernel_size[1]}"
            f"{' dw' if layer.groups > 1 and layer.groups == layer.in_channels else ''}"
            f" [{layer.out_channels}]"
            for layer in self.layers
        )
        what = "width" if self.method == "stacked" else "rank"
        return f"{self.method} {what} {self.rank}: {shapes}"


# --------------------------------------------------------------------------- composing kernels


def dense(layer: Layer) -> torch.Tensor:
    """The layer's weight as an ungrouped [O, C, kh, kw] kernel (zeros across groups)."""
    w, g = layer.weight, layer.groups
    if g == 1:
        return w
    o, cg = w.shape[0] // g, w.shape[1]
    out = w.new_zeros(w.shape[0], cg * g, *w.shape[2:])
    for i in range(g):
        out[i * o : (i + 1) * o, i * cg : (i + 1) * cg] = w[i * o : (i + 1) * o]
    return out


def compose(first: torch.Tensor, then: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The kernel of `then` applied after `first` (stride 1, no padding between them), both
    with `groups`: K[o, c] = sum_m then[o, m] * first[m, c], `*` a full 2-D convolution
    of the taps (cross-correlation of cross-correlations adds the offsets)."""
    # batch = first's input channels, channels = its outputs: one conv sums over m
    kh, kw = then.shape[2:]
    out = F.conv2d(
        first.transpose(0, 1), then.flip(-1, -2), padding=(kh - 1, kw - 1), groups=groups
    )
    return out.transpose(0, 1)


def composed(layers: Sequence[Layer]) -> torch.Tensor:
    """The dense kernel a chain computes (as if its stride and dilation were 1)."""
    same = all(layer.groups == layers[0].groups for layer in layers)
    k = layers[0].weight if same else dense(layers[0])
    for layer in layers[1:]:
        k = compose(k, layer.weight, layer.groups) if same else compose(k, dense(layer))
    return k


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of `a` from `b`."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def refuse_grouped(conv: Layer, what: str) -> None:
    if conv.groups != 1:
        raise RuleError(f"the conv has groups={conv.groups}; {what} takes ungrouped convs only.")
