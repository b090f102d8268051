"""What every model source shares: the LoadedModel record, override parsing, seeding."""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from opswap.errors import SpecError
from opswap.models.task import Task

Source = Literal["zoo", "hf", "torchvision", "timm", "file", "checkpoint"]


@dataclass
class LoadedModel:
    """A model ready for the pipeline: an eval-mode module and inputs for one forward call.

    `example_inputs` are the positional arguments of `module.forward`.
    `settings` records the builder arguments actually used (defaults plus overrides),
    so that a report can say which shapes were measured. `task`, for a model that comes
    with one (the digits models), scores it on a held-out split (models.task).
    `calibration`, for a spec file that defines `calibration()`, gives the batches static
    int8 calibrates on, read only when a plan needs them.
    """

    name: str
    spec: str
    source: Source
    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    description: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    task: Task | None = None
    calibration: CalibrationSource | None = None


@dataclass(frozen=True)
class CalibrationSource:
    """Calibration batches a model's source provides: `fetch()` returns them in any form
    graph.calibration_data reads, and `where` names them ("calibration() in model.py")."""

    fetch: Callable[[], Any]
    where: str


def parse_value(text: Any) -> Any:
    """Turn a `--set key=value` string into a Python value.

    'true'/'false' -> bool, 'none'/'null' -> None, '12' -> int, '1e-5' -> float,
    '[16, 32]' -> list (JSON); anything else stays a string. Non-strings pass through,
    so Python callers can hand over real values.
    """
    if not isinstance(text, str):
        return text
    s = text.strip()
    low = s.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    if s[:1] in "[{":
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            pass
    return s


def parse_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Parse every value of an overrides mapping (keys are kept as given)."""
    if not overrides:
        return {}
    if not isinstance(overrides, Mapping):
        raise SpecError(
            f"Overrides must be a mapping of key to value (from --set key=value), "
            f"got {type(overrides).__name__}."
        )
    return {str(k).strip(): parse_value(v) for k, v in overrides.items()}


def unknown_key_error(key: str, where: str, accepted: list[str] | tuple[str, ...]) -> SpecError:
    keys = ", ".join(sorted(accepted)) if accepted else "none"
    return SpecError(f"Unknown override '{key}' for {where}; accepted keys: {keys}.")


def builder_defaults(fn: Callable) -> dict[str, Any]:
    """Keyword parameters of a builder and their defaults."""
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty
    }


def coerce(key: str, value: Any, default: Any, where: str) -> Any:
    """Check an override against the type of the builder's default, converting int -> float."""
    if default is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise SpecError(f"Override {key} for {where} must be true or false, got {value!r}.")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SpecError(f"Override {key} for {where} must be an integer, got {value!r}.")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise SpecError(f"Override {key} for {where} must be a number, got {value!r}.")
    if isinstance(default, str) and not isinstance(value, str):
        return str(value)
    return value


def resolve_kwargs(fn: Callable, overrides: dict[str, Any], where: str) -> dict[str, Any]:
    """Defaults of builder `fn` updated with type-checked overrides; unknown keys are refused."""
    defaults = builder_defaults(fn)
    for key in overrides:
        if key not in defaults:
            raise unknown_key_error(key, where, list(defaults))
    return {
        k: coerce(k, overrides[k], d, where) if k in overrides else d for k, d in defaults.items()
    }


def positive(where: str, **values: int) -> None:
    """Refuse non-positive sizes with a message naming the override."""
    for key, v in values.items():
        if v < 1:
            raise SpecError(f"Override {key} for {where} must be at least 1, got {v}.")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with torch's global RNG seeded, restoring the caller's RNG state after.

    Default PyTorch initialisers draw from the global generator, so seeding it is what
    makes the weights deterministic; forking keeps the caller's random stream intact.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def as_input_tuple(value: Any, where: str) -> tuple[torch.Tensor, ...]:
    """Normalise example inputs to a tuple of tensors, or explain what is wrong."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return tuple(value)
    kinds = type(value).__name__
    if isinstance(value, (tuple, list)):
        kinds += (
            " of " + ", ".join(sorted({type(v).__name__ for v in value})) if value else " (empty)"
        )
    raise SpecError(
        f"Example inputs from {where} must be a tensor or a tuple of tensors "
        f"(the positional arguments of forward), got {kinds}."
    )
