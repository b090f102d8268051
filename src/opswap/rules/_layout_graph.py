"""Graph questions the layout rules ask: which permutation a node applies, what its
strides are, whether anything writes in place, what may share memory with what,
and how to spell a new node in the flavour of the graph (FX torch calls or ATen).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import TensorMetadata

from opswap.graph.ops import arg, is_aten, op_kind, raw_name
from opswap.graph.shapes import info

aten = torch.ops.aten

# --------------------------------------------------------------------------- flavour




_SPELLINGS = {
    "permute": (aten.permute.default, torch.permute),
    "reshape": (aten.reshape.default, torch.reshape),
    "linear": (aten.linear.default, F.linear),
}


def call(graph: fx.Graph, like: fx.Node, op: str, args: tuple, kwargs=None) -> fx.Node:
    """Create `op` (permute, reshape, linear, contiguous, clone) spelled like `like`'s flavour.

    Use inside `graph.inserting_before/after(...)`.
    """
    kwargs = dict(kwargs or {})
    if op in ("contiguous", "clone"):
        if is_aten(like):
            return graph.call_function(getattr(aten, op).default, args, kwargs)
        return graph.call_method(op, args, kwargs)
    target = _SPELLINGS[op][0 if is_aten(like) else 1]
    return graph.call_function(target, args, kwargs)




def shape_args(graph: fx.Graph, like: fx.Node, src: fx.Node, shape: list) -> list:
    """A reshape's size list with every tuple of input dims (see _layout_shapes) replaced
    by nodes computing the product of `src`'s sizes along them at run time. Use inside
    `graph.inserting_before/after(...)`."""
    out = []
    for item in shape:
        if not isinstance(item, tuple):
            out.append(item)
            continue
        total = None
        for d in item:
            if is_aten(like):
                size = graph.call_function(aten.sym_size.int, (src, d))
            else:
                size = graph.call_method("size", (src, d))
            total = size if total is None else graph.call_function(operator.mul, (total, size))
        out.append(total)
    return out


def erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase `nodes` (given in graph order) that nothing reads any more. Done here, not
    left to dead-code elimination, which keeps random ops such as aten.dropout."""
    for n in reversed(list(nodes)):
        if not n.users:
            graph.erase_node(n)


def by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


# --------------------------------------------------------------------------- permutations


def _rank(node: fx.Node) -> int | None:
    for n in (node, node.args[0] if node.args else None):
        i = info(n)
        if i is not None:
            return len(i.shape)
    return None


def perm_of(node: fx.Node) -> list[int] | None:
    """The permutation a transpose-like node applies (output dim i is input dim p[i]),
    or None when the node is not one or its dims cannot be read."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    name = raw_name(node)
    if name == "getattr" and node.args[1:] in (("mT",), ("T",)):
        name = str(node.args[1])
    if name not in ("transpose", "swapaxes", "swapdims", "t", "permute", "mT", "T"):
        return None
    if not isinstance(node.args[0], fx.Node):
        return None
    rank = _rank(node)
    if rank is None:
        return None
    ident = list(range(rank))
    if name == "T":
        return ident[::-1]
    if name in ("t", "mT"):
        if rank < 2:
            return ident if name == "t" else None
        ident[-2], ident[-1] = ident[-1], ident[-2]
        return ident
    if name == "permute":
        dims = list(node.args[1:]) or list(node.kwargs.get("dims") or ())
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = list(dims[0])
    else:
        dims = [arg(node, 1, "dim0", node.kwargs.get("axis0")),
                arg(node, 2, "dim1", node.kwargs.get("axis1"))]
    if not dims or not all(isinstance(d, int) for d in dims) or rank == 0:
        return None
    dims = [d % rank for d in dims]
    if name == "permute":
        return dims if sorted(dims) == ident else None
    ident[dims[0]], ident[dims[1]] = ident[dims[1]], ident[dims[0]]
    return ident


def compose(first: list[int], then: list[int]) -> list[int]:
    """Permutation of `x.permute(first).permute(then)` as one `x.permute(result)`."""
    return [first[i] for i in then]


# --------------------------------------------------------------------------- strides


def strides(node) -> tuple[int, ...] | None:
    """Strides of a node's tensor as recorded by shape propagation, or None."""
    if not isinstance(node, fx.Node):
        return None
    tm = node.meta.get("tensor_meta")
    if isinstance(tm, TensorMetadata):
        return tuple(int(s) for s in tm.stride)
    return None


def has_layout(shape, stride, memory_format=torch.contiguous_format) -> bool:
    """Whether a tensor of this shape and these strides is contiguous in `memory_format`
    (asked of a storage-free meta tensor, so size-1 dims follow torch's own rules)."""
    t = torch.empty_strided(tuple(shape), tuple(stride), device="meta")
    if memory_format is torch.channels_last and t.dim() != 4:
        return False
    return t.is_contiguous(memory_format=memory_format)


def matmul_reads_in_place(shape, stride) -> bool:
    """Whether torch.matmul can read an operand with these strides without copying it:
    each matrix row- or column-major (BLAS takes either through its transpose flag), and
    the batch dims folding into one stride (matmul reshapes them to one batch dim, which
    copies otherwise)."""
    if len(shape) <= 1:
        return True
    (m, k), (sm, sk) = shape[-2:], stride[-2:]
    if not (sk == 1 or k == 1 or sm == 1 or m == 1):
        return False
    batch = [(s, st) for s, st in zip(shape[:-2], stride[:-2], strict=True) if s != 1]
    return all(st0 == st1 * s1 for (_, st0), (s1, st1) in zip(batch, batch[1:], strict=False))


# --------------------------------------------------------------------------- writes and aliases

# Ops whose output may share memory with their first input (views, and ops that return
# their input unchanged when there is nothing to do). Unknown ops are assumed to.
_ALIAS_KINDS = {"view", "reshape", "flatten", "permute", "transpose", "squeeze", "expand",
                "slice", "split", "identity", "contiguous", "to", "dropout"}


def may_alias_input(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    kind = op_kind(node)
    return kind in _ALIAS_KINDS or kind.startswith("unknown:")


def storage_root(node: fx.Node) -> fx.Node:
    """Walk back through ops that may return a view of their input."""
    while may_alias_input(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def aliases_reach_output(node: fx.Node, skip: fx.Node | None = None) -> bool:
    """Whether `node`, or a view of it, is returned by the graph (not following `skip`)."""
    todo, seen = [node], set()
    while todo:
        cur = todo.pop()
        if cur in seen or cur is skip:
            continue
        seen.add(cur)
        for user in cur.users:
            if user.op == "output":
                return True
            if may_alias_input(user) and user.args and user.args[0] is cur:
                todo.append(user)
    return False
