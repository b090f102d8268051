"""Questions rules ask about nodes, whatever the capture flavour: what is this node's
input, is this value a constant (and which tensor), who else reads it, which
permutation does it apply, what are its strides, what may share memory with it, what
value has one of its settings (`setting(node, "eps")`, whatever the spelling).

Shapes and dtypes are read with `opswap.graph.shapes` (`info`, `shape`,
`shapes_seen`, `dynamic_dims`); the helpers here add only what that module does not
answer. Each answer is a value, or None when the node does not have the property;
reason strings a user reads are built by the rules from these answers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch.fx.node import Argument
from torch.fx.operator_schemas import get_signature_for_torch_op
from torch.fx.passes.shape_prop import TensorMetadata

from opswap.graph.ops import arg, attr_tensor, module_of, op_kind, raw_name
from opswap.graph.shapes import info

# --------------------------------------------------------------------------- inputs, readers


def input_of(node: fx.Node) -> fx.Node | None:
    """The first tensor argument (the activation) of a call."""
    a = node.args[0] if node.args else node.kwargs.get("input")
    return a if isinstance(a, fx.Node) else None


def by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def users_outside(node: fx.Node, allowed: Iterable[fx.Node]) -> list[fx.Node]:
    """Users of `node` that are not in `allowed`."""
    allowed = set(allowed)
    return [u for u in node.users if u not in allowed]


def shared_reason(node: fx.Node, allowed: Iterable[fx.Node], what: str) -> str | None:
    """A sentence saying `node`'s output escapes the pattern, or None when it does not."""
    others = users_outside(node, allowed)
    if not others:
        return None
    names = ", ".join(u.name for u in others[:3])
    return f"{node.name}'s output is also read by {names}, so {what}"


# --------------------------------------------------------------------------- constants


# Ops that only relabel a constant: a weight spelled `self.w.t()` is still a constant.
_CONST_KINDS = {
    "transpose",
    "permute",
    "view",
    "reshape",
    "contiguous",
    "identity",
    "squeeze",
    "expand",
    "flatten",
}


def const(gm: fx.GraphModule, value: Argument, depth: int = 6) -> torch.Tensor | None:
    """The constant tensor `value` stands for, or None when it depends on an input.

    A get_attr node is a constant; so is a short chain of layout ops (t, permute,
    view, ...) applied to one, which is evaluated here.
    """
    if isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, fx.Node) or depth == 0:
        return None
    if value.op == "get_attr":
        return attr_tensor(gm, value)
    if value.op not in ("call_function", "call_method") or op_kind(value) not in _CONST_KINDS:
        return None
    args = []
    for a in value.args:
        if isinstance(a, fx.Node):
            a = const(gm, a, depth - 1)
            if a is None:
                return None
        elif isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            return None
        args.append(a)
    if any(isinstance(v, fx.Node) for v in value.kwargs.values()):
        return None
    with torch.no_grad():
        if value.op == "call_method":
            return getattr(args[0], str(value.target))(*args[1:], **value.kwargs)
        return cast(Callable[..., Any], value.target)(*args, **value.kwargs)


def describe_source(node: object) -> str:
    """'an input of the model' / 'computed by mul_2': where a non-constant comes from."""
    if not isinstance(node, fx.Node):
        return "not a tensor"
    if node.op == "placeholder":
        return f"the model input {node.name}"
    return f"computed at run time by {node.name}"


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
    dims: list[object]
    if name == "permute":
        dims = list(node.args[1:]) or list(cast(Sequence[object], node.kwargs.get("dims") or ()))
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = list(dims[0])
    else:
        dims = [
            arg(node, 1, "dim0", node.kwargs.get("axis0")),
            arg(node, 2, "dim1", node.kwargs.get("axis1")),
        ]
    if not dims or not all(isinstance(d, int) for d in dims) or rank == 0:
        return None
    perm = [cast(int, d) % rank for d in dims]
    if name == "permute":
        return perm if sorted(perm) == ident else None
    ident[perm[0]], ident[perm[1]] = ident[perm[1]], ident[perm[0]]
    return ident


def compose(first: list[int], then: list[int]) -> list[int]:
    """Permutation of `x.permute(first).permute(then)` as one `x.permute(result)`."""
    return [first[i] for i in then]


# --------------------------------------------------------------------------- strides


def strides(node: object) -> tuple[int, ...] | None:
    """Strides of a node's tensor as recorded by shape propagation, or None."""
    if not isinstance(node, fx.Node):
        return None
    tm = node.meta.get("tensor_meta")
    if isinstance(tm, TensorMetadata):
        return tuple(int(s) for s in tm.stride)
    return None


def has_layout(
    shape: Sequence[int],
    stride: Sequence[int],
    memory_format: torch.memory_format = torch.contiguous_format,
) -> bool:
    """Whether a tensor of this shape and these strides is contiguous in `memory_format`
    (asked of a storage-free meta tensor, so size-1 dims follow torch's own rules)."""
    t = torch.empty_strided(tuple(shape), tuple(stride), device="meta")
    if memory_format is torch.channels_last and t.dim() != 4:
        return False
    return t.is_contiguous(memory_format=memory_format)


def matmul_reads_in_place(shape: Sequence[int], stride: Sequence[int]) -> bool:
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
_ALIAS_KINDS = {
    "view",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "squeeze",
    "expand",
    "slice",
    "split",
    "identity",
    "contiguous",
    "to",
    "dropout",
}


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


# --------------------------------------------------------------------------- op settings

#: `setting`'s answer when the op takes no setting of that name
NO_SETTING: Any = type("NoSetting", (), {"__repr__": lambda self: "NO_SETTING"})()


def _signatures(node: fx.Node) -> list[inspect.Signature]:
    """The Python signatures `node`'s call may bind to: the ATen schema of an overload,
    the function's own signature, else its TorchScript schemas (torch.* and F.* builtins);
    a Tensor method takes the signature of the torch function of the same name."""
    target: Any = node.target
    if node.op == "call_method":
        target = getattr(torch, str(target), None)
        if target is None:
            return []
    if isinstance(target, torch._ops.OpOverload):
        return [_schema_signature(target._schema)]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [_schema_signature(getattr(target, o)._schema) for o in target.overloads()]
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(
        p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()
    ):
        return [sig]
    return list(get_signature_for_torch_op(target) or [])


def _schema_signature(schema: torch.FunctionSchema) -> inspect.Signature:
    params = []
    for a in schema.arguments:
        kind = (
            inspect.Parameter.KEYWORD_ONLY
            if a.kwarg_only
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        default = a.default_value if a.has_default_value() else inspect.Parameter.empty
        params.append(inspect.Parameter(a.name, kind, default=default))
    return inspect.Signature(params)


def setting(node: fx.Node, name: str, default: Any = NO_SETTING) -> Any:
    """The value op setting `name` (`beta`, `dim`, `approximate`, `eps`, ...) has at `node`,
    however the call is spelled: a module's attribute of that name, else the argument
    given by keyword or at that setting's position in the op's signature, else the
    signature's default. `default` (NO_SETTING unless given) when the op takes no setting
    of that name, or its signature cannot be read."""
    if node.op == "call_module":
        return getattr(module_of(node), name, default)
    if node.op not in ("call_function", "call_method"):
        return default
    if name in node.kwargs:
        return node.kwargs[name]
    for sig in _signatures(node):
        try:
            bound = sig.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        return bound.arguments.get(name, default)
    return default


@dataclass(frozen=True)
class Refused:
    """A near-match and why it does not qualify, in a user's words. Falsy."""

    reason: str
    where: fx.Node | str | None = None  # the node (or place) it concerns; default the anchor

    def __bool__(self) -> bool:
        return False
