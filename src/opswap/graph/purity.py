"""Which nodes have effects beyond their output, and dead-code elimination that keeps them.

torch.fx's own `eliminate_dead_code` (on the torch versions opswap supports) treats an
unused in-place method call (`h.mul_(2)`, whose result nobody reads because `h` is
what is used afterwards) as dead, and removes it: every rewrite would then silently
delete the model's in-place statements anywhere in the graph. Here a node is live
when anything reads it, or when it writes into a tensor (in-place ops, `out=`,
`x[i] = y`), calls a module that changes its own state (BatchNorm in training mode
updates its running statistics; a module created with `inplace=True` writes into its
input), or is impure by torch's own account (placeholders, outputs, random ops,
side-effectful functions).
"""

from __future__ import annotations

import inspect
import operator
import weakref

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.ops import module_of, raw_name

_INPLACE_OPERATORS = {
    "iadd",
    "isub",
    "imul",
    "itruediv",
    "ifloordiv",
    "imod",
    "ipow",
    "imatmul",
    "iand",
    "ior",
    "ixor",
    "ilshift",
    "irshift",
    "setitem",
}


# target -> its signature when it has an `inplace` parameter, else None. inspect.signature
# costs about as much as the rest of a rewrite's bookkeeping, and every dead-code pass asks
# about every node: asked once per function. Weakly keyed, so a user's function can go.
_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_WEAKREF: dict = {}  # targets that take no weak reference (builtins): few, kept


def _inplace_signature(target) -> inspect.Signature | None:
    for cache in (_SIGNATURES, _NO_WEAKREF):
        try:
            return cache[target]
        except (KeyError, TypeError):
            continue
    try:
        sig: inspect.Signature | None = inspect.signature(target)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and "inplace" not in sig.parameters:
        sig = None
    try:
        _SIGNATURES[target] = sig
    except TypeError:
        try:
            _NO_WEAKREF[target] = sig
        except TypeError:  # not hashable: not cached
            pass
    return sig


def _inplace_flag(node: fx.Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or not callable(node.target):
        return False
    sig = _inplace_signature(node.target)
    if sig is None:
        return False
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


def writes_in_place(node: fx.Node) -> bool:
    """True when the node may write into one of its inputs (x.add_, relu(inplace=True),
    x[i] = y, x += y, out=...)."""
    if node.op == "call_module":
        return bool(getattr(module_of(node), "inplace", False))
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    if "out" in node.kwargs or node.target is operator.setitem:
        return True
    name = raw_name(node)
    if name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__")):
        return True
    return _inplace_flag(node)


def first_write(gm: fx.GraphModule) -> fx.Node | None:
    """The first node of the graph that writes in place, or None."""
    return next((n for n in gm.graph.nodes if writes_in_place(n)), None)


def _stateful_module(mod: nn.Module | None) -> bool:
    """A module whose call may change state: one in training mode that holds buffers
    (BatchNorm's running statistics), or a module that is neither torch.nn's nor opswap's own."""
    if mod is None:
        return True
    if not type(mod).__module__.startswith(("torch.nn", "opswap.")):
        return True
    return any(m.training and any(True for _ in m.buffers(recurse=False)) for m in mod.modules())


def is_impure(node: fx.Node) -> bool:
    """True when the node must stay even if nothing reads its output."""
    if node.op in ("placeholder", "output"):
        return True
    if writes_in_place(node):
        return True
    if node.op == "call_module" and _stateful_module(module_of(node)):
        return True
    try:
        return node.is_impure()
    except Exception:  # an unusual target torch cannot classify: keep it
        return True


def eliminate_dead_code(gm: fx.GraphModule) -> bool:
    """Remove nodes nobody reads that have no effect; True when something was removed.

    A node something reads stays whatever it does, so `is_impure` (a module lookup and
    torch's schema check) is asked only of the unread ones: rules call this after every
    rewrite, and asking it of every node took a sixth of a BERT-base optimize."""
    return gm.graph.eliminate_dead_code(is_impure_node=_kept)


def _kept(node: fx.Node) -> bool:
    return len(node.users) > 0 or is_impure(node)
