"""The user's module is left alone: opswap runs, times and rewrites private copies.

A deep copy of an nn.Module keeps the user's hooks, so timing a copy would still
fire the user's forward hooks thousands of times; `private_copy` drops them unless
asked to keep them. A module can also change itself when called (a call counter
in a buffer, BatchNorm in training mode updating its running statistics):
`preserved_state` puts every buffer back after opswap's own runs, so the model
opswap saves starts in the state it was given in.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from torch import nn

from opswap.errors import OpswapError

_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                "_backward_pre_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


def quiet_deepcopy(obj):
    """A deep copy, quiet about torch's own deprecation noise (pytree's LeafSpec warns when
    the code of an exported graph is copied; nothing the user can act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        return copy.deepcopy(obj)


def count_hooks(module: nn.Module) -> int:
    """Forward and backward hooks registered on the module or any submodule."""
    n = 0
    for m in module.modules():
        for table in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                      "_backward_pre_hooks"):
            n += len(getattr(m, table, {}) or {})
    return n


def private_copy(module: nn.Module, *, keep_hooks: bool = False) -> nn.Module:
    """A deep copy of `module` (weights included) that opswap may run and change; the
    user's forward/backward hooks are dropped unless `keep_hooks`."""
    out = quiet_deepcopy(module)
    if not keep_hooks and isinstance(out, nn.Module):
        for m in out.modules():
            for table in _HOOK_TABLES:
                hooks = getattr(m, table, None)
                if hooks:
                    hooks.clear()
    return out


@contextlib.contextmanager
def preserved_state(*modules):
    """Run the body, then put every buffer of the nn.Modules among `modules` back to its
    value before. Parameters are checked, not copied (that would double the model's
    memory): a forward that writes into a parameter raises an OpswapError."""
    mods = [m for m in modules if isinstance(m, nn.Module)]
    saved = []
    versions = []
    seen: set[int] = set()
    for mod in mods:
        for m in mod.modules():
            for name, b in m._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    saved.append((m, name, b, b.detach().clone()))
        for name, p in mod.named_parameters():
            versions.append((name, p, p._version))
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, original, value in saved:
                current = m._buffers.get(name)
                if current is original and not original.is_inference():
                    original.copy_(value)
                else:  # the forward rebound the buffer (self.x = self.x + 1)
                    m._buffers[name] = value
    changed = [name for name, p, v in versions if p._version != v]
    if changed:
        raise OpswapError(
            f"The model writes into its parameter {changed[0]} when it runs, so its results "
            "depend on how often it was called; make that state a buffer or move the update "
            "out of forward.")
