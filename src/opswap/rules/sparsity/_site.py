"""What the sparsity rules share: reading a Linear site (weight, rows at the example
shape) and timing the dense layer against the sparse one at that shape on the target,
cached per shape, so that a site is kept only where it measures faster."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from opswap.graph.ops import module_of
from opswap.graph.shapes import info
from opswap.rules._matching import input_of
from opswap.rules._weights import Weighted, weighted
from opswap.rules.base import Refused
from opswap.rules.sparsity._modules import SemiSparseLinear, SparseLinear
from opswap.targets.base import Timer

_TIMED: dict[tuple[Hashable, ...], tuple[float, float]] = {}


@dataclass(frozen=True)
class Site:
    w: Weighted
    rows: int  # batch x tokens at the example shape
    k: int
    n: int


def read_site(gm: fx.GraphModule, node: fx.Node) -> Site | Refused | None:
    """The Linear at `node` with a constant 2-D weight and an input of known shape."""
    if isinstance(module_of(node), (SemiSparseLinear, SparseLinear)):
        return None
    w = weighted(gm, node)
    if isinstance(w, str):
        return Refused(w)
    if w.weight.dim() != 2:
        return None
    n, k = w.weight.shape
    x = input_of(node)
    xi = info(x) if x is not None else None
    if xi is None or not xi.dtype.is_floating_point:
        return Refused(f"the input of {node.name} is not a floating-point tensor of known shape")
    return Site(w, max(1, xi.numel // max(k, 1)), int(k), int(n))


def timed(
    key: tuple[Hashable, ...],
    timer: Timer,
    make: Callable[[], tuple[Callable[[], Any], Callable[[], Any]]],
) -> tuple[float, float]:
    """(dense, sparse) seconds of the two calls `make()` builds, by the target's timer,
    cached by `key` and the thread count."""
    full = (*key, torch.get_num_threads(), timer)
    hit = _TIMED.get(full)
    if hit is None:
        dense, sparse = make()
        with torch.inference_mode():
            res = timer({"dense": dense, "sparse": sparse})
        hit = _TIMED[full] = (float(res["dense"]), float(res["sparse"]))
    return hit


def random_linear(
    m: int, k: int, n: int, dtype: torch.dtype, device: str | torch.device, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x, W, b) of a Linear at this shape, seeded by it."""
    g = torch.Generator().manual_seed(m * 31 + k * 7 + n)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


def dense_call(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> Callable[[], torch.Tensor]:
    return lambda: F.linear(x, w, b)
