"""The checks of the layout rules: does this node qualify, and if not, why not.

Each check returns a `Check` holding either a description of the site or the reason
a user reads in the report, or None when the node is not a candidate at all.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.ops import arg, attr_tensor, is_aten, module_of, op_kind, raw_name
from opswap.graph.purity import first_write
from opswap.graph.shapes import info, strides_seen
from opswap.rules._layout_graph import (
    aliases_reach_output,
    has_layout,
    matmul_reads_in_place,
    storage_root,
    strides,
)


@dataclass
class Check:
    ok: str | None = None  # the site's description when the node qualifies
    why: str | None = None  # the miss reason when it does not
    data: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- dropout


def dropout_state(node: fx.Node) -> tuple[object, object, str] | None:
    """(p, training, label) of a dropout module or call, or None if the node is not one."""
    if node.op == "call_module":
        mod = module_of(node)
        if not isinstance(mod, nn.modules.dropout._DropoutNd):
            return None
        return mod.p, mod.training, str(node.target)
    if node.op not in ("call_function", "call_method") or op_kind(node) != "dropout":
        return None
    if raw_name(node) == "native_dropout":
        return None  # returns (output, mask): the mask has readers of its own
    if is_aten(node):
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    else:
        try:
            bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            p, training = bound.arguments.get("p", 0.5), bound.arguments.get("training", True)
        except (TypeError, ValueError):
            p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
    return p, training, _module_path(node)


def _module_path(node: fx.Node) -> str:
    """The Dropout module an exported call came from ('encoder.drop'), else the node name."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        if "Dropout" in getattr(cls, "__name__", str(cls)) and path:
            return str(path)
    return node.name


def dropout_check(node: fx.Node) -> Check | None:
    state = dropout_state(node)
    if state is None:
        return None
    p, training, label = state
    if isinstance(training, fx.Node) or isinstance(p, fx.Node):
        return Check(why=f"Dropout {label}'s mode is decided at run time")
    if training and p != 0:
        return Check(why=f"Dropout {label} is in training mode: it zeroes activations at "
                     "random; call .eval() to remove it")
    return Check(f"Dropout {label} " + ("is in eval mode" if not training else "has p = 0"))


# --------------------------------------------------------------------------- identities

_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
          "bfloat16": torch.bfloat16}


def _same_dtype_cast(node: fx.Node) -> bool:
    """`.to(dtype)` / `.float()` ... to the dtype the tensor already has, without copy=True:
    torch returns the input itself."""
    name = raw_name(node)
    src, out = info(node.args[0]), info(node)
    if src is None or out is None or src.dtype != out.dtype:
        return False
    if name in _CASTS:
        return len(node.args) == 1 and not node.kwargs and _CASTS[name] == src.dtype
    if name != "to":
        return False
    rest = list(node.args[1:])
    dtype = rest.pop(0) if rest and isinstance(rest[0], torch.dtype) else node.kwargs.get("dtype")
    if len(rest) > 2 or not all(isinstance(v, bool) for v in rest):
        return False  # a device, a tensor to match, or flags we do not read
    flags = dict(zip(("non_blocking", "copy"), rest, strict=False))
    flags.update((k, v) for k, v in node.kwargs.items() if k != "dtype")
    fmt = flags.pop("memory_format", None)
    flags.pop("non_blocking", None)
    copy = flags.pop("copy", False)
    return dtype == src.dtype and not copy and not flags and fmt in (None, torch.preserve_format)


def identity_check(gm: fx.GraphModule, node: fx.Node) -> Check | None:
    """Whether `node` returns its input (or a copy nobody needs) and can go."""
    if node.op == "call_module":
        return Check(f"{node.name} is an nn.Identity") if isinstance(
            module_of(node), nn.Identity) else None
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    src, name = node.args[0], raw_name(node)
    if not isinstance(src, fx.Node):
        return None
    if name == "alias":
        return Check(f"{node.name} is an alias of {src.name}")
    if op_kind(node) == "to" and name != "_to_copy":
        ok = _same_dtype_cast(node)
        return Check(f"{node.name} casts to the dtype {src.name} already has") if ok else None
    if name not in ("contiguous", "clone", "_to_copy"):
        return None
    if name == "_to_copy" and (set(node.kwargs) - {"dtype", "memory_format", "non_blocking"}
                               or len(node.args) > 1):
        return None  # a device or layout change
    i, s_in, s_out = info(src), strides(src), strides(node)
    if i is None or s_in is None or s_out is None:
        return Check(why=f"the strides of {src.name} are not known, so {node.name} cannot "
                     "be shown to be a no-op")
    root = storage_root(src)
    if name == "contiguous":
        fmt = arg(node, 1, "memory_format", torch.contiguous_format)
        if not has_layout(i.shape, s_in, fmt):
            return Check(why=f"{src.name} is not contiguous (strides {s_in}), so "
                         f"{node.name} is a real copy")
        other = next(((sh, st) for sh, st in strides_seen(src)[1:]
                      if not has_layout(sh, st, fmt)), None)
        if other is not None:
            return Check(why=f"{src.name} is contiguous at the example's shape but not at "
                         f"{list(other[0])} (strides {list(other[1])}), so {node.name} is a "
                         "real copy there")
        if root.op == "placeholder":
            return Check(why=f"{node.name} lays out the model input {root.name}, which "
                         "callers may pass with any strides")
        return Check(f"{src.name} is already contiguous")
    # clone / _to_copy: a fresh copy. Dropping it only changes who shares memory.
    if info(node) is None or info(node).dtype != i.dtype:
        return None
    if s_in != s_out or [st for _, st in strides_seen(src)] != [st for _, st in strides_seen(node)]:
        return Check(why=f"{node.name} changes the strides of {src.name} ({s_in} -> {s_out})")
    writer = first_write(gm)
    if writer is not None:
        return Check(why=f"the graph writes into tensors in place ({writer.name}), so "
                     f"{node.name}'s copy may be protecting {src.name}")
    if aliases_reach_output(node) and (
            root.op in ("placeholder", "get_attr") or aliases_reach_output(root, skip=node)):
        return Check(why=f"without {node.name} the output would share memory with {root.name}")
    return Check(f"nothing writes into {src.name} or its copy {node.name}")


# --------------------------------------------------------------------------- matmul operands

MATMULS = {"matmul", "mm", "bmm", "__matmul__"}


def is_matmul(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and raw_name(node) in MATMULS


def constant_transpose_check(gm, node: fx.Node, perm: list[int]) -> Check | None:
    """A transpose of a constant read by a matmul: as linear(x, W), or stored permuted."""
    mms = [u for u in node.users if is_matmul(u)]
    if not mms:
        return None
    w_node = node.args[0]
    w = attr_tensor(gm, w_node)
    if w is None:
        return Check(why=f"{w_node.name} is not a tensor constant")
    mm = mms[0]
    if (len(node.users) == 1 and w.dim() == 2 and perm == [1, 0]
            and raw_name(mm) in ("matmul", "__matmul__", "mm") and len(mm.args) == 2
            and not mm.kwargs and mm.args[1] is node and mm.args[0] is not node):
        return Check(f"{mm.name}: x @ {w_node.name}^T as linear(x, {w_node.name})",
                     data={"mode": "linear", "key": f"linear:{mm.name}", "also": [mm.name]})
    return Check(f"{node.name}: store {w_node.name} permuted by {tuple(perm)} once",
                 data={"mode": "pretranspose", "key": f"pretranspose:{node.name}", "perm": perm})


def strided_operand_check(node: fx.Node, src: fx.Node) -> Check | None:
    """`transpose -> contiguous -> matmul`: can matmul read the transpose directly?"""
    fmt = arg(node, 1, "memory_format", torch.contiguous_format)
    users = list(node.users)
    if fmt not in (torch.contiguous_format, torch.preserve_format) or not any(
            is_matmul(u) for u in users):
        return None
    if not all(is_matmul(u) for u in users):
        others = ", ".join(u.name for u in users if not is_matmul(u))
        return Check(why=f"{node.name}'s output is also read by {others}, which may need "
                     "contiguous memory")
    i, st = info(src), strides(src)
    if i is None or st is None:
        return Check(why=f"the strides of {src.name} are not known")
    if not matmul_reads_in_place(i.shape, st):
        return Check(why=f"torch.matmul would copy {src.name} itself (strides {st} are not "
                     "a batch of row- or column-major matrices whose batch dims fold into "
                     "one), so dropping the contiguous saves nothing")
    for mm in users:
        for other in mm.args[:2]:
            o = info(other) if other is not node else None
            if o is not None and (len(o.shape) > len(i.shape) or (
                    len(o.shape) > 2 and o.shape[:-2] != i.shape[:-2])):
                return Check(why=f"{mm.name} broadcasts {src.name} over other batch dims, "
                             "which makes torch.matmul copy it")
    return Check(f"{node.name}: {users[0].name} reads {src.name} strided, without the copy",
                 data={"mode": "contiguous", "key": f"contiguous:{node.name}"})


def drop_attr_if_unused(gm: fx.GraphModule, attr_node: fx.Node) -> None:
    """Delete a constant nothing reads any more, so its old layout is not kept in memory."""
    if attr_node.users:
        return
    target = str(attr_node.target)
    owner = target.rpartition(".")[0]
    for n in gm.graph.nodes:
        if n is not attr_node and n.op == "get_attr" and n.target == target:
            return
        if n.op == "call_module" and owner and (
                str(n.target) == owner or owner.startswith(f"{n.target}.")
                or str(n.target).startswith(f"{owner}.")):
            return  # a module call may read it internally
    gm.graph.erase_node(attr_node)
    parent = gm.get_submodule(owner) if owner else gm
    delattr(parent, target.rpartition(".")[2])
