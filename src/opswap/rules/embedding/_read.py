"""Reading embedding bags in any capture flavour: `read_pooled` (a lookup then a sum or
mean over the bag dim, the per-sample weights multiplied in) and `read_bag` (an
F.embedding_bag call, an nn.EmbeddingBag module, or a one-table opswap::
batched_embedding_bag), and the constants they need."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.ops import arg, module_of, op_kind, raw_name
from opswap.graph.shapes import info, shape
from opswap.rules._cost import saving
from opswap.rules._edits import swap_in_module
from opswap.rules._matching import const, setting
from opswap.rules.base import Estimate, Found
from opswap.targets.base import Target

BATCHED = "unknown:batched_embedding_bag"


@dataclass
class Bag:
    """A pooled lookup: indices [B, L] into `weight` ([R, D]), sum or mean over L."""

    out: fx.Node  # the node holding the pooled [B, D]
    nodes: list[fx.Node]  # what a rewrite removes
    idx: fx.Node
    weight: fx.Node | str  # a node, or the path of a module's weight (call_module)
    table: torch.Tensor | None  # the weight's tensor, when it is a constant
    mean: bool
    psw: fx.Node | None  # per-sample weights [B, L]
    length: int  # L at the example
    rows: int
    dim: int
    dtype: torch.dtype
    # a quantized opswap op's extra constants (the int8 and half rules)
    scale: fx.Node | None = None
    bias: fx.Node | None = None


def _lookup(gm: fx.GraphModule, e: fx.Node) -> tuple[fx.Node, fx.Node | str] | str | None:
    """(indices, weight) of an embedding lookup, a reason it cannot pool, or None."""
    if op_kind(e) != "embedding":
        return None
    if e.op == "call_module":
        mod = module_of(e)
        if type(mod) is not nn.Embedding:  # a hashed or pruned table of opswap's
            return None
        if mod.max_norm is not None:
            return f"{e.name} renormalises rows to max_norm {mod.max_norm} as it reads them"
        idx = e.args[0] if e.args else None
        weight: fx.Node | str = f"{e.target}.weight"
    elif raw_name(e) == "embedding" and e.op == "call_function" and "aten" in str(e.target):
        weight, idx = e.args[0], e.args[1]  # type: ignore[assignment]
    else:  # F.embedding(input, weight, padding_idx, max_norm, ...)
        idx, weight = arg(e, 0, "input"), arg(e, 1, "weight")  # type: ignore[assignment]
        if setting(e, "max_norm", None) is not None:
            return f"{e.name} renormalises rows to max_norm as it reads them"
    if not isinstance(idx, fx.Node) or not isinstance(weight, (fx.Node, str)):
        return None
    return idx, weight


def table_of(gm: fx.GraphModule, weight: fx.Node | str) -> torch.Tensor | None:
    if isinstance(weight, str):
        return gm.get_parameter(weight).detach() if weight else None
    t = const(gm, weight)
    return t.detach() if isinstance(t, torch.Tensor) else None


def _psw_of(m: fx.Node, e: fx.Node) -> fx.Node | str | None:
    """The per-sample weights w of `m = e * w.unsqueeze(-1)`, a reason, or None."""
    if op_kind(m) != "mul" or len(m.args) != 2:
        return None
    other = m.args[1] if m.args[0] is e else m.args[0] if m.args[1] is e else None
    if not isinstance(other, fx.Node):
        return None
    if op_kind(other) == "squeeze" and raw_name(other) == "unsqueeze":
        d = setting(other, "dim", None)
        src = other.args[0]
        es = shape(e)
        if isinstance(src, fx.Node) and es is not None and d in (-1, len(es) - 1):
            ss = shape(src)
            if ss is not None and tuple(ss) == tuple(es[:-1]):
                return src
    return f"{m.name} scales the rows by something other than per-sample weights [B, L, 1]"


def read_pooled(gm: fx.GraphModule, node: fx.Node) -> Bag | str | None:
    """The bag a sum or mean over dim 1 of an embedding lookup (weighted or not) pools."""
    if op_kind(node) not in ("sum", "mean") or not node.args:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    psw: fx.Node | None = None
    nodes = [node]
    e = src
    if op_kind(src) == "mul":
        for cand in src.args:
            if isinstance(cand, fx.Node) and op_kind(cand) == "embedding":
                got = _psw_of(src, cand)
                if isinstance(got, str):
                    return got
                if got is None:
                    return None
                e, psw = cand, got
                nodes = [src, node]
                break
        else:
            return None
    look = _lookup(gm, e)
    if look is None or isinstance(look, str):
        return look
    idx, weight = look
    ii, ei = info(idx), info(e)
    if ii is None or ei is None:
        return None
    if len(ii.shape) != 2:
        return f"{e.name} looks up indices of {len(ii.shape)} dims; a bag is [batch, L]"
    dim = setting(node, "dim", None)
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    if not isinstance(dim, int) or dim % 3 != 1:
        return f"{node.name} pools over dim {dim}, not the bag (dim 1)"
    if setting(node, "keepdim", False) or setting(node, "dtype", None) is not None:
        return f"{node.name} keeps the bag dim or accumulates in another dtype"
    mean = op_kind(node) == "mean"
    if not ei.dtype.is_floating_point:
        return None
    table = table_of(gm, weight)
    return Bag(
        node, [e, *nodes], idx, weight, table, mean, psw, int(ii.shape[1]),
        int(table.shape[0]) if table is not None else 0, int(ei.shape[-1]), ei.dtype,
    )  # fmt: skip


def _one_stacked(t: fx.Node) -> tuple[tuple[int, ...] | None, fx.Node | None]:
    """(shape, x) for t = stack([x], 1), the one-table form embedding.bag writes."""
    if op_kind(t) != "cat" or raw_name(t) != "stack" or len(t.users) != 1:
        return None, None
    items = t.args[0]
    if not isinstance(items, (list, tuple)) or len(items) != 1 or not isinstance(items[0], fx.Node):
        return None, None
    return shape(items[0]), items[0]


def read_bag(gm: fx.GraphModule, node: fx.Node) -> Bag | str | None:
    """An embedding bag already: F.embedding_bag / nn.EmbeddingBag over indices [B, L]
    without offsets, or a one-table opswap::batched_embedding_bag (its [B, 1, D] output
    read through a select of table 0)."""
    kind = op_kind(node)
    oi = info(node)
    if oi is None:
        return None
    if kind == BATCHED:
        w, off, idx, psw, mean, scale, bias, out_dtype = node.args
        if len(node.users) != 1 or not isinstance(idx, fx.Node):
            return None
        (sel,) = node.users
        if op_kind(sel) not in ("slice", "squeeze"):
            return None
        one, idx1 = _one_stacked(idx)
        if one is None:
            return None
        nodes = [idx, node, sel]
        psw1 = None
        if isinstance(psw, fx.Node):
            _, psw1 = _one_stacked(psw)
            if psw1 is None:
                return None
            nodes.insert(1, psw)
        table = table_of(gm, w)  # type: ignore[arg-type]
        return Bag(
            sel, nodes, idx1, w, table, bool(mean), psw1,  # type: ignore[arg-type]
            int(one[1]), int(table.shape[0]) if table is not None else 0,
            int(oi.shape[-1]), oi.dtype, scale, bias,  # type: ignore[arg-type]
        )  # fmt: skip
    if kind != "embedding_bag" or "aten" in str(node.target):
        return None
    if node.op == "call_module":
        mod = module_of(node)
        assert isinstance(mod, nn.EmbeddingBag)
        if mod.max_norm is not None or mod.padding_idx is not None or mod.mode == "max":
            return f"{node.name} uses max_norm, padding_idx or max pooling"
        idx = node.args[0] if node.args else None
        offsets = arg(node, 1, "offsets", None)
        psw = arg(node, 2, "per_sample_weights", None)
        weight: fx.Node | str = f"{node.target}.weight"
        mode = mod.mode
    else:
        idx, weight = arg(node, 0, "input"), arg(node, 1, "weight")  # type: ignore[assignment]
        offsets = arg(node, 2, "offsets", None)
        mode = setting(node, "mode", "mean")
        psw = setting(node, "per_sample_weights", None)
        if setting(node, "max_norm", None) is not None or setting(node, "padding_idx", None):
            return f"{node.name} uses max_norm or padding_idx"
        if mode == "max":
            return f"{node.name} pools by max"
    if offsets is not None or not isinstance(idx, fx.Node):
        return f"{node.name} takes 1-D indices with offsets; the batched op takes [B, L] bags"
    ii = info(idx)
    if ii is None or len(ii.shape) != 2:
        return None
    table = table_of(gm, weight)
    return Bag(
        node, [node], idx, weight, table, mode == "mean",
        psw if isinstance(psw, fx.Node) else None, int(ii.shape[1]),
        int(table.shape[0]) if table is not None else 0, int(oi.shape[-1]), oi.dtype,
    )  # fmt: skip


def any_bag(gm: fx.GraphModule, node: fx.Node) -> Bag | str | None:
    return read_bag(gm, node)


def table_bytes(rows: int, dim: int, dtype: torch.dtype, per_row: int = 0) -> int:
    """A table's bytes: rows x dim elements, plus `per_row` bytes of each row's constants."""
    return rows * (dim * torch.empty((), dtype=dtype).element_size() + per_row)


def kib(n: int) -> str:
    if n < 10240:
        return f"{n} B"
    return f"{n / 1024:.0f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def shrunk(
    node: fx.Node, what: str, before: int, after: int, data: dict[str, Any], record: dict[str, Any]
) -> Found:
    """The Found of a rule that shrinks the table at `node` from `before` to `after` bytes:
    `what` it does in the description, the bytes in the record."""
    return Found(
        [node],
        f"{node.target}: {what}, {kib(before)} -> {kib(after)}",
        data,
        record=dict(record, bytes_before=before, bytes_after=after),
    )


def swap_table(
    gm: fx.GraphModule, found: Found, make: Callable[[torch.Tensor], nn.Module], name: str
) -> None:
    """Put `make(weight)` in place of the nn.Embedding module read at found.nodes[0]."""
    node = found.nodes[0]
    mod = module_of(node)
    assert isinstance(mod, nn.Embedding)
    swap_in_module(gm, make(mod.weight.detach()), tuple(node.args), node, [node], name)


def memory_estimate(found: Found, target: Target, least: float | None = None) -> Estimate:
    """The bytes a table rule saves (its record's bytes_before - bytes_after), the time
    from the cost model (at least `least` seconds when given)."""
    rec = found.record
    time_s = saving(target, [], [], "").time_saved_s
    if least is not None:
        time_s = max(time_s or 0.0, least)
    return Estimate(
        0.0,
        float(rec["bytes_before"] - rec["bytes_after"]),
        time_s,
        f"table {kib(rec['bytes_before'])} -> {kib(rec['bytes_after'])}",
    )
