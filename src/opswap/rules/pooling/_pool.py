"""The settings of a pooling node, read whatever the spelling: nn.MaxPool2d, F.max_pool2d,
aten.max_pool2d(_with_indices), and the same for average pooling. Lists become tuples
of the pool's rank; a stride left out is the kernel size, as PyTorch takes it."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from opswap.graph.ops import raw_name
from opswap.rules._matching import input_of, setting
from opswap.rules.base import Refused


@dataclass(frozen=True)
class Pool:
    """One pooling op: rank (1, 2 or 3) and its settings as tuples of that rank."""

    rank: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    ceil_mode: bool
    count_include_pad: bool
    divisor_override: int | None
    return_indices: bool

    def text(self) -> str:
        """'3x3 stride 2 padding 1' in a sentence."""
        return (
            f"{'x'.join(map(str, self.kernel))} stride {'x'.join(map(str, self.stride))} "
            f"padding {'x'.join(map(str, self.padding))}"
        )


def _tuple(v: object, n: int) -> tuple[int, ...] | None:
    if isinstance(v, int):
        return (v,) * n
    if isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
        if len(v) == n:
            return tuple(int(x) for x in v)
        if len(v) == 1:
            return (int(v[0]),) * n
    return None


def rank_of(node: fx.Node) -> int | None:
    """1, 2 or 3 from the op's name ('max_pool2d', 'AvgPool3d', ...), else None."""
    m = re.search(r"(\d)d", raw_name(node))
    return int(m.group(1)) if m else None


_UNSET = object()
# positions in F.max_pool*d / F.avg_pool*d, for spellings whose signature cannot be read
# (F.max_pool2d is a boolean_dispatch wrapper without one)
_MAX_POS = {"kernel_size": 1, "stride": 2, "padding": 3, "dilation": 4, "ceil_mode": 5}
_AVG_POS = {"kernel_size": 1, "stride": 2, "padding": 3, "ceil_mode": 4}
_AVG_POS.update(count_include_pad=5, divisor_override=6)


def _get(node: fx.Node, name: str, default: object) -> object:
    v = setting(node, name, _UNSET)
    if v is not _UNSET:
        return v
    if name in node.kwargs:
        return node.kwargs[name]
    pos = (_MAX_POS if "max" in raw_name(node) else _AVG_POS).get(name)
    if node.op == "call_function" and pos is not None and len(node.args) > pos:
        return node.args[pos]
    return default


def pool(node: fx.Node) -> Pool | str:
    """The node's settings, or why they cannot be read (computed at run time)."""
    d = rank_of(node)
    if d is None:
        return f"{node.name} is a {raw_name(node)}, whose rank opswap does not read"
    kernel = _tuple(_get(node, "kernel_size", None), d)
    raw_stride = _get(node, "stride", None)
    stride = kernel if raw_stride in (None, [], ()) else _tuple(raw_stride, d)
    padding = _tuple(_get(node, "padding", 0), d)
    dilation = _tuple(_get(node, "dilation", 1), d)
    if kernel is None or stride is None or padding is None or dilation is None:
        return f"{node.name}'s kernel, stride or padding are computed at run time"
    divisor = _get(node, "divisor_override", None)
    return Pool(
        d,
        kernel,
        stride,
        padding,
        dilation,
        bool(_get(node, "ceil_mode", False)),
        bool(_get(node, "count_include_pad", True)),
        divisor if isinstance(divisor, int) else None,
        bool(_get(node, "return_indices", False)) or "with_indices" in raw_name(node),
    )


def read(node: fx.Node) -> tuple[fx.Node, Pool] | Refused | None:
    """(input, settings) of a pool node: None where its input is not a node, Refused where
    its settings cannot be read."""
    x = input_of(node)
    if x is None:
        return None
    p = pool(node)
    if isinstance(p, str):
        return Refused(p)
    return x, p
