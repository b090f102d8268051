"""The user's module is left alone: opswap runs, times and rewrites private copies.

A deep copy of an nn.Module keeps the user's hooks, so timing a copy would still
fire the user's forward hooks thousands of times; `private_copy` drops them unless
asked to keep them. Hooks and parametrisations that compute a weight before each
call (torch.nn.utils.weight_norm and spectral_norm, torch.nn.utils.parametrize)
are part of what the module computes, not the user's instrumentation: copies keep
them, so a copy computes what the user's module computes when called, and
`materialise_weights` turns them into plain parameters on the copy that gets
captured. A module can also change itself when called (a call counter in a
buffer, BatchNorm in training mode updating its running statistics):
`preserved_state` puts every buffer back after opswap's own runs, so the model
opswap saves starts in the state it was given in.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import warnings
from typing import TypeVar, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from opswap.errors import OpswapError
from opswap.kernels._versions import version

_HOOKS = {
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
}
# per-hook flags, keyed by the hook's id like the tables above
_HOOK_FLAGS = (
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)
# parametrisation classes torch.nn.utils.parametrizations registers, by the name users know
_PARAMETRIZATIONS = {
    "_WeightNorm": "weight_norm",
    "_SpectralNorm": "spectral_norm",
    "_Orthogonal": "orthogonal",
}
_M = TypeVar("_M", bound=nn.Module)


@functools.cache
def _weight_hook_classes() -> dict[type, str]:
    """The forward pre-hooks of the old, hook-based torch.nn.utils.weight_norm and
    spectral_norm (deprecated for torch.nn.utils.parametrizations, still present in torch
    2.11-2.14): {class: kind}; a torch without one of them has no such hook to find."""
    found = {}
    for where, name, kind in (
        ("torch.nn.utils.weight_norm", "WeightNorm", "weight_norm"),
        ("torch.nn.utils.spectral_norm", "SpectralNorm", "spectral_norm"),
    ):
        try:
            cls = getattr(importlib.import_module(where), name, None)
        except ImportError:
            cls = None
        if isinstance(cls, type):
            found[cls] = kind
    return found


def _weight_kind(hook) -> str | None:
    """'weight_norm' or 'spectral_norm' for a hook that computes a weight, else None."""
    for cls, kind in _weight_hook_classes().items():
        if isinstance(hook, cls):
            return kind
    return None


def _parametrization_kind(plist) -> str:
    return "+".join(
        _PARAMETRIZATIONS.get(type(p).__name__, f"parametrization {type(p).__name__}")
        for p in plist
    )


def weight_hooks(module: nn.Module) -> list[tuple[str, str]]:
    """(module path, kind) of every weight the module computes before a call: the old
    weight_norm/spectral_norm hooks and parametrisations (kind "weight_norm", ...)."""
    out = []
    for path, m in module.named_modules():
        for hook in (getattr(m, "_forward_pre_hooks", None) or {}).values():
            kind = _weight_kind(hook)
            if kind is not None:
                out.append((path, kind))
        if parametrize.is_parametrized(m):
            out.extend(
                (path, _parametrization_kind(plist)) for plist in m.parametrizations.values()
            )
    return out


def _root(module: nn.Module) -> nn.Module:
    """The user's module inside opswap's keyword wrapper, so that paths read as theirs."""
    from opswap.graph.keywords import KeywordCall

    return module.model if isinstance(module, KeywordCall) else module


def _programs_own(hook) -> bool:
    """A hook that the loader of an exported program puts on the module it hands back: the
    program's input checks and state handling (torch.export._unlift on torch 2.11-2.14),
    or opswap's own lean loader's check (backends.pt2); not the user's."""
    fn = getattr(hook, "func", hook)  # a functools.partial
    where = getattr(fn, "__module__", None) or ""
    return where.startswith(("torch.export", "opswap.backends"))


def user_hooks(module: nn.Module) -> list[tuple[str, str]]:
    """(module path, kind) of the user's forward and backward hooks on the module or any
    submodule ("" for the module itself; kind "forward hook", "forward pre-hook", ...);
    the hooks that compute weights (`weight_hooks`) and a loaded program's own hooks
    (a model.pt2's input checks) are not among them."""
    out = []
    for path, m in _root(module).named_modules():
        for table, kind in _HOOKS.items():
            for hook in (getattr(m, table, None) or {}).values():
                if _weight_kind(hook) is None and not _programs_own(hook):
                    out.append((path, kind))
    return out


def count_hooks(module: nn.Module) -> int:
    """The user's forward and backward hooks on the module or any submodule."""
    return len(user_hooks(module))


def describe_hooks(hooks: list[tuple[str, str]], most: int = 4) -> str:
    """'a forward hook on fc and a forward pre-hook on the model', for `user_hooks`."""
    said = [f"a {kind} on {path or 'the model'}" for path, kind in hooks[:most]]
    if len(hooks) > most:
        said.append(f"{len(hooks) - most} more")
    return said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]


@contextlib.contextmanager
def leafspec_quiet():
    """Quiet about torch's own deprecation noise while an exported graph's code is copied
    (pytree's LeafSpec warns; nothing the user can act on): copy.deepcopy of it here, and
    AOTInductor's packaging, which copies the program (backends.aoti)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        yield


def quiet_deepcopy(obj, memo: dict | None = None):
    """A deep copy, quiet about torch's LeafSpec deprecation (`leafspec_quiet`)."""
    with leafspec_quiet():
        return copy.deepcopy(obj, memo)


def _detached(module: nn.Module) -> dict[int, torch.Tensor]:
    """A deepcopy memo standing in a detached clone for every non-leaf tensor a module keeps
    as a plain attribute. A fresh weight_norm or spectral_norm module keeps its computed
    `weight` so, and deepcopy refuses non-leaf tensors (pytorch#103001); the hook computes
    the weight again on every call, so the copy loses nothing."""
    memo = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                memo[id(value)] = value.detach().clone()
    return memo


def private_copy(module: _M, *, keep_hooks: bool = False) -> _M:
    """A deep copy of `module` (weights included) that opswap may run and change; the
    user's forward/backward hooks are dropped unless `keep_hooks`, the hooks and
    parametrisations that compute weights are kept."""
    if not isinstance(module, nn.Module):
        return quiet_deepcopy(module)
    out = quiet_deepcopy(module, _detached(module))
    if not keep_hooks:
        for m in out.modules():
            dropped = []
            for table in _HOOKS:
                hooks = getattr(m, table, None) or {}
                for key in [k for k, h in hooks.items() if _weight_kind(h) is None]:
                    del hooks[key]
                    dropped.append(key)
            for table in _HOOK_FLAGS:
                flags = getattr(m, table, None)
                if flags:
                    for key in dropped:
                        flags.pop(key, None)
    return out


def materialise_weights(module: nn.Module) -> list[str]:
    """Make every weight that a hook or parametrisation computes before a call (see
    `weight_hooks`) a plain parameter holding what it computes now, in place: only ever on
    a private copy. The value is computed in the module's current mode (spectral norm in
    eval mode uses its stored u and v, as a call would). Returns 'path.name (kind)' of each."""
    from torch.nn.utils import remove_spectral_norm, remove_weight_norm

    done = []
    for path, m in list(_root(module).named_modules()):
        prefix = f"{path}." if path else ""
        for hook in list((getattr(m, "_forward_pre_hooks", None) or {}).values()):
            kind = _weight_kind(hook)
            if kind is None:
                continue
            (remove_weight_norm if kind == "weight_norm" else remove_spectral_norm)(m, hook.name)
            done.append(f"{prefix}{hook.name} ({kind})")
        if parametrize.is_parametrized(m):
            done.extend(f"{prefix}{name} ({kind})" for name, kind in _unparametrize(m))
    return done


def _unparametrize(m: nn.Module) -> list[tuple[str, str]]:
    """Replace m's parametrisations by what they compute now; [(name, kind)].

    Not parametrize.remove_parametrizations: a deep copy shares the class torch made for
    the parametrised module (ParametrizedLinear, which holds the `weight` property) with
    the user's module, and that function deletes the property from the class, so the
    user's module would lose its weight."""
    found = []
    with torch.no_grad():
        for name, plist in cast(nn.ModuleDict, m.parametrizations).items():
            original = cast(torch.Tensor, plist.original if plist.is_tensor else plist.original0)
            value = getattr(m, name).detach().clone()
            found.append(
                (
                    name,
                    _parametrization_kind(plist),
                    value,
                    isinstance(original, nn.Parameter),
                    original.requires_grad,
                )
            )
    m.__class__ = parametrize.type_before_parametrizations(m)
    del m._modules["parametrizations"]
    for name, _, value, is_param, grad in found:
        if is_param:
            m.register_parameter(name, nn.Parameter(value, requires_grad=grad))
        else:
            m.register_buffer(name, value)
    return [(name, kind) for name, kind, *_ in found]


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
            versions.append((name, p, version(p)))
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
    # a parameter made under torch.inference_mode has no version counter: not checkable
    changed = [name for name, p, v in versions if version(p) != v]
    if changed:
        raise OpswapError(
            f"The model writes into its parameter {changed[0]} when it runs, so its results "
            "depend on how often it was called; make that state a buffer or move the update "
            "out of forward."
        )
