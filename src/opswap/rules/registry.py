"""Every rule opswap knows, by name. Rule modules register themselves on import.

Rules are found, not listed: every subpackage of `opswap.rules` is a family
(rules/fusion/, rules/layout/, ...), and every module in it whose name does not
start with `_` holds one rule class decorated with `@register`. A new rule is a
new file there (and its test); nothing else names it.
"""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil

from opswap.errors import RuleError
from opswap.rules.base import EXACTNESS_ORDER, PHASES, Rule

_RULES: dict[str, Rule] = {}

_loaded = False


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator: add a rule to the registry (one instance per class)."""
    for attr in ("name", "family", "chapter", "exactness"):
        if not hasattr(cls, attr):
            raise TypeError(f"rule {cls.__name__} lacks the class attribute {attr!r}")
    if cls.exactness not in EXACTNESS_ORDER:
        raise TypeError(f"rule {cls.name}: exactness must be exact, approx or lossy")
    if cls.phase not in PHASES:
        raise TypeError(f"rule {cls.name}: phase must be one of {', '.join(PHASES)}")
    for attr in ("after", "before"):
        value = getattr(cls, attr)
        if not isinstance(value, tuple) or not all(isinstance(p, str) for p in value):
            raise TypeError(f"rule {cls.name}: {attr} must be a tuple of rule names or globs, "
                            f"e.g. ('fusion.conv_bn',)")
    if cls.name in _RULES and type(_RULES[cls.name]) is not cls:
        raise TypeError(f"two rules are named {cls.name!r}")
    _RULES[cls.name] = cls()
    return cls


def rule_modules() -> list[str]:
    """Dotted names of the modules that hold rules: the public modules of each family
    subpackage of opswap.rules, in name order."""
    import opswap.rules as package

    found = []
    for fam in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not fam.ispkg or fam.name.startswith("_"):
            continue
        family = importlib.import_module(f"{package.__name__}.{fam.name}")
        for mod in sorted(pkgutil.iter_modules(family.__path__), key=lambda m: m.name):
            if not mod.name.startswith("_"):
                found.append(f"{family.__name__}.{mod.name}")
    return found


def _load() -> None:
    """Import every rule module, on first use so that `import opswap` stays light."""
    global _loaded
    if not _loaded:
        for mod in rule_modules():
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
        looser = sorted({r.exactness for r in all_rules()
                         if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)},
                        key=EXACTNESS_ORDER.get)
        if looser:
            raise RuleError(
                f"{','.join(patterns)} selects only {looser[0]} rules, which exactness "
                f"{exactness!r} leaves out; add --exactness {looser[0]} to plan them.")
        raise RuleError(
            f"No rule matches {','.join(patterns)!r} at exactness {exactness!r}; "
            "`opswap rules` lists them."
        )
    return chosen
