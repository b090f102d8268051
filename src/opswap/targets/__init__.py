"""Hardware targets: peak FLOP/s per precision, memory bandwidth, preferences.

>>> from opswap.targets import get_target
>>> h100 = get_target("h100")
>>> round(h100.ridge_point("bfloat16"))   # FLOP per byte
295
"""

from __future__ import annotations

from opswap.errors import TargetError
from opswap.targets.base import DTYPE_KEYS, Target, dtype_key
from opswap.targets.cpu import get_cpu_target
from opswap.targets.edge.profiles import EDGE_TARGETS
from opswap.targets.nvidia import NVIDIA_TARGETS

__all__ = ["DTYPE_KEYS", "Target", "dtype_key", "get_target", "list_targets", "register_target"]

_REGISTRY: dict[str, Target] = {**NVIDIA_TARGETS, **EDGE_TARGETS}
_ALIASES = {
    "h100-sxm": "h100",
    "h100_sxm": "h100",
    "h200-sxm": "h200",
    "a100-sxm": "a100",
    "a100-80gb": "a100",
    "host": "cpu",
}


def list_targets() -> list[str]:
    """Names of the known targets, sorted ('cpu' is measured on first use)."""
    return sorted({*_REGISTRY, "cpu"})


def register_target(target: Target) -> None:
    """Make a user-defined target available to get_target by its name."""
    _REGISTRY[target.name.lower()] = target


def get_target(name: str | Target, *, refresh: bool = False) -> Target:
    """The Target called `name` (case-insensitive); a Target passes through unchanged.

    'cpu' is this machine, measured once and cached; `refresh=True` measures again.
    Raises TargetError naming the known targets when `name` is not one of them.
    """
    if isinstance(name, Target):
        return name
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key == "cpu":
        return get_cpu_target(refresh=refresh)
    if key in _REGISTRY:
        return _REGISTRY[key]
    raise TargetError(f"Unknown target {name!r}; known targets are {', '.join(list_targets())}.")
