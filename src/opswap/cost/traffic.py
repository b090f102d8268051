"""Bytes each FX node moves: what it reads (inputs and weights) plus what it writes.

Every op is costed as if it ran alone, with nothing left in cache from the op
before it: an op reads each distinct input tensor once (a broadcast, stride-0
dimension once, not once per repeat), reads its weights once, and writes each
output. That is the unfused cost; a fusion rule saves the write
of an intermediate and its re-read by the next op.

Ops that only relabel memory move nothing: view, reshape and flatten when the
input's strides allow a view, transpose / permute / t, expand, (un)squeeze, basic
slicing and getitem, split / chunk / unbind, detach, `.to` to the same dtype,
`.contiguous()` of a tensor that already is, and dropout in eval mode. A later
`.contiguous()` (or a reshape that cannot view) is where the copy is paid, and
it is costed there: read the input, write the output.
An embedding reads only the rows it gathers (plus the indices), not the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from opswap.cost._nodes import (
    module_weights,
    nbytes,
    out_info,
    out_infos,
    read_bytes,
    strided_meta,
    tensor_inputs,
    tinfo,
)
from opswap.cost.pointwise import training_dropout
from opswap.graph.ops import arg, module_of, op_kind, raw_name

VIEW_NOTE = "view: moves no data (a later .contiguous() or copying reshape pays)"


@dataclass(frozen=True)
class Traffic:
    read: int
    written: int
    note: str = ""

    @property
    def total(self) -> int:
        return self.read + self.written


_FREE = Traffic(0, 0, VIEW_NOTE)

# Always views, whatever the input's layout.
_VIEW_NAMES = {
    "view",
    "_unsafe_view",
    "unflatten",
    "permute",
    "transpose",
    "t",
    "swapaxes",
    "swapdims",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "broadcast_to",
    "split",
    "chunk",
    "split_with_sizes",
    "unbind",
    "narrow",
    "slice",
    "select",
    "alias",
    "detach",
    "Unflatten",
    "movedim",
    "as_strided",
    "diagonal",
    "unfold",
    "view_as",
}
# Copy data that the op reads only partly: read what is gathered, write the result.
_GATHER_NAMES = {"index_select", "gather", "index", "take", "take_along_dim"}


def _default(node: fx.Node, skip: tuple[int, ...] = ()) -> Traffic:
    read = sum(read_bytes(n, ti) for n, ti in tensor_inputs(node, skip))
    read += sum(nbytes(t) for t in module_weights(node))
    written = sum(o.nbytes for o in out_infos(node))
    return Traffic(read, written)


def _copy(node: fx.Node, note: str) -> Traffic:
    """Read the (first) input once, write the output: a plain copy."""
    o = out_info(node)
    ins = tensor_inputs(node)
    read = read_bytes(*ins[0]) if ins else 0
    return Traffic(read, o.nbytes if o else 0, note)


def _can_view(src: fx.Node, shape: tuple[int, ...]) -> bool:
    t = strided_meta(src)
    if t is None:
        return True  # unknown strides: assume a contiguous producer
    try:
        t.view(shape)
        return True
    except RuntimeError:
        return False


def _reshape(node: fx.Node) -> Traffic:
    src = node.args[0] if node.args else None
    o = out_info(node)
    if not isinstance(src, fx.Node) or o is None or _can_view(src, o.shape):
        return _FREE
    return _copy(node, "reshape of a non-viewable layout copies")


def _contiguous(node: fx.Node) -> Traffic:
    if raw_name(node) == "clone":
        return _copy(node, "clone copies")
    src = node.args[0] if node.args else None
    fmt = arg(node, 1, "memory_format", torch.contiguous_format)
    t = strided_meta(src)
    if t is not None and not isinstance(fmt, fx.Node) and t.is_contiguous(memory_format=fmt):
        return Traffic(0, 0, "already contiguous: no copy")
    return _copy(node, "copies a non-contiguous input")


def _getitem(node: fx.Node) -> Traffic:
    src = node.args[0] if node.args else None
    index = node.args[1] if len(node.args) > 1 else None
    src_info = tinfo(src)
    if src_info is None or len(out_infos(cast(fx.Node, src))) > 1:  # src: a node here
        return _FREE  # picking one output of a tuple-returning op
    items = index if isinstance(index, (list, tuple)) else (index,)
    tensor_index = [i for i in items if isinstance(i, fx.Node) and tinfo(i) is not None]
    lists = [i for i in items if isinstance(i, list)]
    if not tensor_index and not lists:
        return _FREE  # basic indexing: a view
    return _gather(node)


def _gather(node: fx.Node) -> Traffic:
    o = out_info(node)
    out_bytes = o.nbytes if o else 0
    index_bytes = sum(ti.nbytes for _, ti in tensor_inputs(node, skip=(0,)))
    return Traffic(out_bytes + index_bytes, out_bytes, "reads only the gathered elements")


def _embedding(node: fx.Node) -> Traffic:
    o = out_info(node)
    out_bytes = sum(x.nbytes for x in out_infos(node))
    if module_of(node) is not None:
        idx = tensor_inputs(node)
    else:  # aten.embedding(weight, indices, ...), embedding_bag(weight, indices, offsets, ...)
        idx = tensor_inputs(node, skip=(0,))
    index_bytes = sum(ti.nbytes for _, ti in idx)
    if op_kind(node) == "embedding_bag":
        mod = module_of(node)
        table = cast(torch.Tensor, mod.weight) if mod is not None else tinfo(node.args[0])
        row = (table.shape[-1] if table is not None else 0) * _itemsize_of(node)
        gathered = (idx[0][1].numel if idx else 0) * row
    else:
        gathered = o.nbytes if o else 0
    return Traffic(index_bytes + gathered, out_bytes, "reads only the gathered rows")


def _itemsize_of(node: fx.Node) -> int:
    o = out_info(node)
    return torch.empty((), dtype=o.dtype).element_size() if o else 4


def _to(node: fx.Node) -> Traffic:
    ins = tensor_inputs(node)
    o = out_info(node)
    if ins and o and ins[0][1].dtype == o.dtype and ins[0][1].shape == o.shape:
        return Traffic(0, 0, "no dtype change: no copy")
    return _copy(node, "dtype conversion")


def node_traffic(node: fx.Node) -> Traffic:
    """Bytes read and written by one compute node, run on its own."""
    kind = op_kind(node)
    name = raw_name(node)
    if kind == "identity" or name in _VIEW_NAMES:
        return _FREE
    if not out_infos(node):
        return Traffic(0, 0, "no tensor output (shape arithmetic, an assert)")
    if kind == "dropout":
        if not training_dropout(node):
            return Traffic(0, 0, "dropout in eval mode: identity")
        return _default(node)
    if kind in ("reshape", "flatten") or name == "Flatten":
        return _reshape(node)
    if kind == "contiguous":
        return _contiguous(node)
    if name == "getitem":
        return _getitem(node)
    if name in _GATHER_NAMES:
        return _gather(node)
    if kind in ("embedding", "embedding_bag"):
        return _embedding(node)
    if kind == "to":
        return _to(node)
    return _default(node)
