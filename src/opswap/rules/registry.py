"""Every rule opswap knows, by name. Rule modules register themselves on import."""

from __future__ import annotations

import fnmatch
import importlib

from opswap.errors import RuleError
from opswap.rules.base import EXACTNESS_ORDER, Rule

_RULES: dict[str, Rule] = {}

# Rule family modules, imported on first use so `import opswap` stays light.
_FAMILY_MODULES = ("opswap.rules.fusion", "opswap.rules.layout")
_loaded = False


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator: add a rule to the registry (one instance per class)."""
    for attr in ("name", "family", "chapter", "exactness"):
        if not hasattr(cls, attr):
            raise TypeError(f"rule {cls.__name__} lacks the class attribute {attr!r}")
    if cls.exactness not in EXACTNESS_ORDER:
        raise TypeError(f"rule {cls.name}: exactness must be exact, approx or lossy")
    if cls.name in _RULES and type(_RULES[cls.name]) is not cls:
        raise TypeError(f"two rules are named {cls.name!r}")
    _RULES[cls.name] = cls()
    return cls


def _load() -> None:
    global _loaded
    if not _loaded:
        for mod in _FAMILY_MODULES:
            importlib.import_module(mod)
        _loaded = True


def all_rules() -> list[Rule]:
    """All registered rules, sorted by chapter then name."""
    _load()
    return sorted(_RULES.values(), key=lambda r: (r.chapter, r.name))


def get(name: str) -> Rule:
    _load()
    try:
        return _RULES[name]
    except KeyError:
        raise RuleError(
            f"No rule named {name!r}; `opswap rules` lists them ({', '.join(sorted(_RULES))})."
        ) from None


def select(
    patterns: list[str] | str | None = None,
    exactness: str = "exact",
    target: str | None = None,
) -> list[Rule]:
    """Rules whose name matches one of the glob patterns (default: all), no looser than
    `exactness`, and expected to pay on `target` (None: any)."""
    _load()
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    if exactness not in EXACTNESS_ORDER:
        raise RuleError(f"exactness must be one of exact, approx, lossy; got {exactness!r}.")
    limit = EXACTNESS_ORDER[exactness]
    chosen = []
    for rule in all_rules():
        if patterns and not any(fnmatch.fnmatchcase(rule.name, p) for p in patterns):
            continue
        if EXACTNESS_ORDER[rule.exactness] > limit:
            continue
        if target is not None and not rule.applies_to(target):
            continue
        chosen.append(rule)
    if patterns and not chosen:
        raise RuleError(
            f"No rule matches {','.join(patterns)!r} at exactness {exactness!r}; "
            "`opswap rules` lists them."
        )
    return chosen
