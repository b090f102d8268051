"""Edit a captured graph: new constants, swapped weights and modules, new nodes in the
graph's own flavour, and the clean-up that keeps the state_dict free of tensors
nothing reads any more.

Two habits run through it. Names are kept where possible: a module or attribute
used only by the rewritten node is replaced in place, so 'conv1.weight' stays
'conv1.weight'; a shared one is copied to a fresh name, so the other reader is
unaffected. And every node a rewrite creates gets the shape metadata of the node
it replaces, so later matches in the same pass can read its shape.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.node import Argument

from opswap.graph.ops import arg, attr_tensor, copy_meta, is_aten, set_attr_tensor
from opswap.rules._weights import Weighted

aten = torch.ops.aten


def _exclusive_module(gm: fx.GraphModule, node: fx.Node) -> bool:
    """True when no other node calls this module or reads its tensors."""
    target = str(node.target)
    for n in gm.graph.nodes:
        if n is node:
            continue
        if n.op == "call_module" and str(n.target) == target:
            return False
        if n.op == "get_attr" and str(n.target).startswith(target + "."):
            return False
    return True


def _exclusive_attr(gm: fx.GraphModule, attr_node: fx.Node, user: fx.Node) -> bool:
    """True when `attr_node` is a get_attr read only by `user`, and no other node reads
    the same attribute (directly or through a module)."""
    if attr_node.op != "get_attr" or set(attr_node.users) != {user}:
        return False
    target = str(attr_node.target)
    for n in gm.graph.nodes:
        if n is attr_node:
            continue
        if n.op == "get_attr" and str(n.target) == target:
            return False
        if n.op == "call_module" and target.startswith(str(n.target) + "."):
            return False
    return True


def new_const(
    gm: fx.GraphModule, before: fx.Node, base: str, tensor: torch.Tensor, as_param: bool = True
) -> fx.Node:
    """Install `tensor` as a fresh attribute of gm and return a get_attr node for it,
    inserted before `before`. `base` may be dotted ('attention.qkv.weight')."""
    name = fresh_path(gm, base)
    set_attr_tensor(gm, name, tensor, as_param=as_param)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(name)


def _has_path(gm: nn.Module, dotted: str) -> bool:
    obj = gm
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _set_arg(node: fx.Node, index: int, name: str, value: Argument) -> None:
    if len(node.args) > index:
        node.update_arg(index, value)
    elif name in node.kwargs or len(node.args) < index:
        node.update_kwarg(name, value)
    else:
        node.args = (*node.args, value)


def _write_attr(
    gm: fx.GraphModule, w: Weighted, index: int, name: str, tensor: torch.Tensor
) -> None:
    node = w.node
    old = arg(node, index, name)
    as_param = old is None or isinstance(attr_tensor(gm, old), nn.Parameter)
    if isinstance(old, fx.Node) and _exclusive_attr(gm, old, node):
        set_attr_tensor(gm, str(old.target), tensor, as_param=as_param)
        return
    base = (
        f"{str(old.target)}_folded"
        if isinstance(old, fx.Node) and old.op == "get_attr"
        else f"{node.name}_{name}"
    )
    _set_arg(node, index, name, new_const(gm, node, base, tensor, as_param))


def replace_weights(
    gm: fx.GraphModule, w: Weighted, weight: torch.Tensor, bias: torch.Tensor | None
) -> fx.Node:
    """Make `w.node` compute with new weight and bias; returns the node that does.

    A module called only here gets its tensors replaced in place (its state_dict keys
    stay the same); a shared module is copied to a fresh name first. In the function
    flavour an attribute read only here is overwritten, else a new one is added.
    """
    node = w.node
    if node.op == "call_module":
        module = cast(nn.Module, w.module)  # a call_module site's Weighted carries its module
        mod = copy.deepcopy(module)
        grad = cast(torch.Tensor, module.weight).requires_grad
        mod.weight = nn.Parameter(weight, requires_grad=grad)
        # torch's stubs type Module.__setattr__ without None, which a parameter slot accepts
        mod.bias = (
            None
            if bias is None
            else nn.Parameter(  # type: ignore[assignment]
                bias, requires_grad=mod.weight.requires_grad
            )
        )
        return install_module(gm, node, mod, str(node.target))
    _write_attr(gm, w, 1, "weight", weight)
    if bias is not None:
        _write_attr(gm, w, 2, "bias", bias)
    return node


def fresh_path(gm: nn.Module, base: str) -> str:
    name, i = base, 0
    while _has_path(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def install_module(
    gm: fx.GraphModule, node: fx.Node, mod: nn.Module, base: str, args: tuple | None = None
) -> fx.Node:
    """Put `mod` where `node` calls its module and return the node that calls it.

    A call_module node whose module no one else uses keeps its target (so state_dict
    keys stay the same) and is returned; otherwise `mod` goes to a fresh name
    derived from `base` and a new call_module node (on `args`, default the node's)
    replaces `node`.
    """
    if node.op == "call_module" and _exclusive_module(gm, node) and args is None:
        gm.add_submodule(str(node.target), mod)
        return node
    name = fresh_path(gm, base.replace(".", "_"))
    gm.add_submodule(name, mod)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(
            name, node.args if args is None else args, node.kwargs if args is None else {}
        )
    copy_meta(new, node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def free_container(gm: fx.GraphModule, attr_node: Argument) -> str | None:
    """The module path holding `attr_node`'s attribute ('layer.conv' for
    'layer.conv.weight') when nothing left in the graph reads anything under it, so
    a replacement module can take its place and its name; else None.

    Unused get_attr nodes under that path (export graphs keep one per parameter)
    are erased when the path is returned."""
    if not isinstance(attr_node, fx.Node) or attr_node.op != "get_attr":
        return None
    path = str(attr_node.target).rpartition(".")[0]
    if not path:
        return None
    stale = []
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module") and (
            str(n.target) == path or str(n.target).startswith(path + ".")
        ):
            if n.op == "get_attr" and not n.users:
                stale.append(n)
                continue
            return None
    for n in stale:
        gm.graph.erase_node(n)
    return path


def place_module(gm: fx.GraphModule, mod: nn.Module, path: str | None, base: str) -> str:
    """Install `mod` at `path` (a container `free_container` found, replaced whole) or
    else at a fresh name from `base`; returns the target to call."""
    if path:
        parent, _, leaf = path.rpartition(".")
        delattr(gm.get_submodule(parent) if parent else gm, leaf)
    else:
        path = fresh_path(gm, base.replace(".", "_"))
    gm.add_submodule(path, mod)
    return path


def swap_in_module(
    gm: fx.GraphModule,
    mod: nn.Module,
    args: tuple,
    out: fx.Node,
    removed: Iterable[fx.Node],
    base: str,
    home: Argument = None,
) -> fx.Node:
    """Call `mod` on `args` in place of the pattern ending at `out`: the call takes
    over `out`'s users, the `removed` nodes and their dead constants go, and the
    module is named after the container of `home`'s attribute ('ln' for the get_attr
    'ln.weight') when nothing reads that container any more, else after `base`."""
    tmp = place_module(gm, mod, None, base)
    with gm.graph.inserting_before(out):
        new = gm.graph.call_module(tmp, args)
    copy_meta(new, out)
    out.replace_all_uses_with(new)
    drop_dead_attrs(gm, erase(gm, removed))
    path = free_container(gm, home)
    if path:
        delattr(gm, tmp)
        new.target = place_module(gm, mod, path, tmp)
    return new


def erase(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """Erase the given nodes (latest first) that no longer have users; returns the
    get_attr nodes they read that are still in the graph, for `drop_dead_attrs`.
    Done here, not left to dead-code elimination, which keeps random ops such as
    aten.dropout."""
    consts: list[fx.Node] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted({n for n in nodes if n in order}, key=lambda n: -order[n]):
        if not n.users:
            consts += const_args(n)
            gm.graph.erase_node(n)
    alive = set(gm.graph.nodes)
    return [c for c in dict.fromkeys(consts) if c in alive]


def drop_dead_attrs(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> None:
    """Erase get_attr nodes among `nodes` that lost every user, and the attributes behind
    them when nothing else reads those (another get_attr, or a module call that may read
    it internally), so the state_dict loses the folded tensors too."""
    for n in list(nodes):
        if not isinstance(n, fx.Node) or n.op != "get_attr" or n.users:
            continue
        if n not in set(gm.graph.nodes):
            continue
        target = str(n.target)
        owner = target.rpartition(".")[0]
        gm.graph.erase_node(n)
        if any(m.op == "get_attr" and str(m.target) == target for m in gm.graph.nodes):
            continue
        if any(
            m.op == "call_module"
            and (
                target.startswith(str(m.target) + ".")
                or (owner and str(m.target).startswith(owner + "."))
            )
            for m in gm.graph.nodes
        ):
            continue
        *parents, leaf = target.split(".")
        obj: object = gm
        for p in parents:
            obj = getattr(obj, p, None)
        if obj is not None and hasattr(obj, leaf):
            delattr(obj, leaf)


def const_args(node: fx.Node) -> list[fx.Node]:
    """The get_attr nodes among a node's arguments (to clean up after it is removed)."""
    out = []
    for a in [*node.args, *node.kwargs.values()]:
        if isinstance(a, fx.Node) and a.op == "get_attr":
            out.append(a)
    return out


# --------------------------------------------------------------------------- new nodes, in the graph's flavour


def _aten_op(op: str) -> torch._ops.OpOverload:
    """aten.<op>'s overload for `op` ("silu", or "log_softmax.int" to pick one)."""
    name, _, overload = op.partition(".")
    packet = getattr(aten, name, None)
    if packet is None:
        raise ValueError(f"there is no ATen op named {name!r}")
    overload = overload or "default"
    if overload not in packet.overloads():
        raise ValueError(
            f"aten.{name} has no overload {overload!r} (it has "
            f"{', '.join(packet.overloads())}); spell it as '{name}.<overload>'"
        )
    return getattr(packet, overload)


def _torch_fn(op: str) -> Callable[..., Any] | None:
    """The Python function an FX graph spells `op` with: torch.<op>, else F.<op>; None
    when it is only a Tensor method."""
    name = op.partition(".")[0]
    for home in (torch, F):
        fn = getattr(home, name, None)
        if callable(fn):
            return fn
    return None


def call(
    graph: fx.Graph,
    like: fx.Node,
    op: str,
    args: tuple,
    kwargs: Mapping[str, Argument] | None = None,
) -> fx.Node:
    """Create a call of `op` spelled in `like`'s flavour: `aten.<op>` (".default", or the
    overload named after a dot: "log_softmax.int") in an ATen graph; `torch.<op>`,
    `F.<op>` or the Tensor method of that name in an FX graph.

    Use inside `graph.inserting_before/after(...)`.
    """
    kwargs = dict(kwargs or {})
    if is_aten(like):
        return graph.call_function(_aten_op(op), args, kwargs)
    fn = _torch_fn(op)
    if fn is not None and op.partition(".")[0] not in ("contiguous", "clone"):
        return graph.call_function(fn, args, kwargs)
    return graph.call_method(op.partition(".")[0], args, kwargs)


def replace_with(
    gm: fx.GraphModule,
    out: fx.Node,
    target: fx.node.Target,
    args: tuple,
    kwargs: dict | None = None,
    *,
    remove: Iterable[fx.Node] | None = None,
) -> fx.Node:
    """The rewrite most rules end with, in one call: a call of `target` on `args`, inserted
    before `out` with `out`'s metadata, takes over every reader of `out`; then the nodes
    in `remove` (default: `out` alone) that nothing reads any more are erased, and the
    weights only they read dropped. `target` is an op name spelled in the graph's flavour
    (`call`: "silu", "log_softmax.int") or a callable called as it is (an OpOverload such
    as torch.ops.opswap.glu.default, or F.linear). Returns the new node."""
    graph = gm.graph
    with graph.inserting_before(out):
        if isinstance(target, str):
            new = call(graph, out, target, args, kwargs)
        else:
            new = graph.call_function(target, args, dict(kwargs or {}))
    copy_meta(new, out)
    out.replace_all_uses_with(new)
    drop_dead_attrs(gm, erase(gm, [out] if remove is None else list(remove)))
    return new


def shape_args(graph: fx.Graph, like: fx.Node, src: fx.Node, shape: list) -> list:
    """A reshape's size list with every tuple of input dims (see layout/collapse_view) replaced
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
