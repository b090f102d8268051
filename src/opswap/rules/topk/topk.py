"""topk.topk: torch.topk over the last dim -> `opswap::topk`, opswap's Triton top-k
(kernels/topk.py: a bitonic register sort for rows up to 4096, a tile merge for longer rows
and k <= 64, radix select beyond), on CUDA, only where the crossover table measured it
faster than torch.topk for the shape class (row length, k and rows in power-of-two
buckets); every other site keeps torch.topk, so the rule is never slower where measured."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.node import Argument

from opswap.graph.ops import raw_name
from opswap.graph.shapes import info
from opswap.kernels import crossover
from opswap.kernels import topk as T
from opswap.rules._cost import saving
from opswap.rules._matching import setting
from opswap.rules._triton import CPU_REASON
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.rules.topk import _read
from opswap.targets.base import Target

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def const_k(k: Argument) -> int | None:
    """k as an int: a constant, or the min(k, size) that topk.sort_slice writes for a
    dynamic row."""
    if isinstance(k, int) and not isinstance(k, bool):
        return k
    if isinstance(k, fx.Node) and k.target is torch.sym_min and isinstance(k.args[0], int):
        return int(k.args[0])
    return None


def read_topk(node: fx.Node) -> tuple[fx.Node, int, int, int, bool, bool] | str | None:
    """(x, k, n, rows, largest, sorted) of a torch.topk over the last dim, else why not."""
    if raw_name(node) != "topk" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x = node.args[0]
    xi = info(x)
    if xi is None or not xi.shape:
        return f"the shape of {x.name} is unknown"
    k = const_k(setting(node, "k", None))
    if k is None:
        return f"k of {node.name} is computed at run time; the kernel's launch needs it fixed"
    dim = setting(node, "dim", -1)
    if not isinstance(dim, int) or dim % len(xi.shape) != len(xi.shape) - 1:
        return f"{node.name} takes the top-k over dim {dim}; the kernel takes the last dim"
    if xi.dtype not in _DTYPES:
        return f"{x.name} is {xi.dtype}; the kernel takes float32, float16 or bfloat16"
    n = int(xi.shape[-1])
    if not 0 < k <= n:
        return None
    for u in node.users:
        if not (u.target is operator.getitem or u.target is getattr):
            return f"{u.name} reads the (values, indices) pair of {node.name} whole"
    largest = bool(setting(node, "largest", True))
    return x, k, n, xi.numel // max(n, 1), largest, bool(setting(node, "sorted", True))


@register
class TopK(Rule):
    """torch.topk -> opswap::topk where measured faster. Exact: identical values (NaN
    ordered above +inf as torch does); equal values come with ascending indices, where
    torch.topk promises no order among them."""

    name = "topk.topk"
    implementation = "triton"
    family = "topk"
    chapter = 17
    exactness = "exact"
    targets = ("cuda", "cpu")
    after = ("topk.sort_slice",)
    relieves = ("compute:reduction", "memory:reduction")
    anchors = ("topk",)
    description = (
        "torch.topk over the last dim -> opswap::topk (Triton: bitonic register sort, tile "
        "merge or radix select), only at shape classes measured faster than torch.topk (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        got = read_topk(node)
        if got is None or isinstance(got, str):
            return Refused(got) if isinstance(got, str) else None
        x, k, n, rows, largest, sorted_ = got
        xi = info(x)
        assert xi is not None
        return Found(
            [node],
            f"topk({k}) of {x.name} over {n} ({rows} rows) -> opswap::topk ({T.path(n, k)})",
            dict(x=x, k=node.args[1] if len(node.args) > 1 else setting(node, "k")),
            record=dict(x=x.name, k=k, n=n, rows=rows, path=T.path(n, k)),
            kn=(k, n, rows, largest, sorted_),
            dtype=xi.dtype,
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        _, _, _, largest, sorted_ = found["kn"]
        args = (found["x"], found["k"], largest, sorted_)
        _read.replace_pair(gm, found.nodes[0], torch.ops.opswap.topk.default, args)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        k, n, rows, _, _ = found["kn"]
        if getattr(target, "kind", "cpu") != "cuda":
            overhead = target.op_overhead(True) if hasattr(target, "op_overhead") else 0.0
            return Estimate(0.0, 0.0, -max(overhead, 1e-9), CPU_REASON)
        dev = crossover.device_class(target)
        cls = T.shape_class(n, k, rows)
        entry = crossover.lookup("topk", dev, found["dtype"], n, rows, shape=cls)
        if entry is None or not entry.beats_eager or not entry.speedup_vs_eager:
            why = (
                f"measured at {entry.speedup_vs_eager}x torch.topk at {cls} on {dev} "
                f"({entry.source})"
                if entry is not None
                else f"no measurement of the kernel at {cls} on {dev}: torch.topk kept"
            )
            return Estimate(0.0, 0.0, -1e-9, why)
        before = saving(target, found.nodes).time_saved_s or 0.0  # torch.topk's own time
        return Estimate(
            0.0,
            0.0,
            max(before * (1 - 1 / entry.speedup_vs_eager), 1e-9),
            f"{cls}: measured at {entry.speedup_vs_eager}x torch.topk on {dev} ({entry.source})",
        )
