"""Every rule opswap knows, by name. Rule modules register themselves on import.

Rules are found, not listed: every subpackage of `opswap.rules` is a family
(rules/fusion/, rules/layout/, ...), and every module in it whose name does not
start with `_` holds one rule class decorated with `@register`. A new rule is a
new file there (and its test); nothing else names it.

Rules from elsewhere register the same way and are listed like built-in ones, with
where they came from (`origin`):

- installed packages declare a module (or a rule class) in the `opswap.rules`
  entry-point group; it is imported on first use of the registry. A plugin that
  fails to import or holds a rule that fails validation is left out whole, with one
  sentence in `problems()`; the other rules are unaffected;
- `load_module("mymodule")` (the CLI's `--rules-from mymodule`) imports a module
  or a .py file the user names, and raises a RuleError when it cannot.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import pkgutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType

from opswap.errors import RuleError
from opswap.rules.base import EXACTNESS_ORDER, PHASES, Rule

#: the entry-point group installed packages declare their rules in
ENTRY_POINT_GROUP = "opswap.rules"

#: rules that were renamed: old name -> current name. A plan.json, a --rules pattern or
#: an after/before declaration that names a rule by its old name finds it under its new
#: one (the Triton rules lost their `_triton` suffix: the kernel kind is the rule's
#: `implementation` now). A new entry goes here whenever a rule is renamed.
RENAMED: dict[str, str] = {
    "activation.pointwise_triton": "activation.pointwise",
    "activation.swiglu_triton": "activation.swiglu",
    "attention.flash_triton": "attention.flash",
    "fusion.rope_triton": "fusion.rope",
    "norm.add_rms_norm_triton": "norm.add_rms_norm",
    "norm.group_norm_triton": "norm.group_norm",
    "norm.layer_norm_triton": "norm.layer_norm",
    "norm.rms_norm_triton": "norm.rms_norm",
    "reduce.sum_of_squares_triton": "reduce.sum_of_squares",
    "softmax.softmax_triton": "softmax.softmax",
}


def current_name(name: str) -> str:
    """The name a rule goes by now: `name` itself, or its new name when it was renamed."""
    return RENAMED.get(name, name)


def former_names(name: str) -> tuple[str, ...]:
    """The old names of the rule now called `name` (none for most rules)."""
    return tuple(old for old, new in RENAMED.items() if new == name)


def matches(name: str, pattern: str) -> bool:
    """Whether glob `pattern` names the rule called `name`, by its name or an old one."""
    return any(fnmatch.fnmatchcase(n, pattern) for n in (name, *former_names(name)))


_RULES: dict[str, Rule] = {}
_ORIGINS: dict[str, str] = {}  # rule name -> where it came from, for `opswap rules`
_PROBLEMS: list[str] = []  # one sentence per plugin left out
_loading: str | None = None  # the origin of the rules registering right now

_loaded = False
_plugins_loaded = False


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator: add a rule to the registry (one instance per class)."""
    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        raise TypeError(f"@register takes a subclass of opswap.rules.Rule, not {cls!r}")
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
            raise TypeError(
                f"rule {cls.name}: {attr} must be a tuple of rule names or globs, "
                f"e.g. ('fusion.conv_bn',)"
            )
    if not isinstance(cls.name, str) or "." not in cls.name:
        raise TypeError(f"rule {cls.__name__}: name must be 'family.what', got {cls.name!r}")
    if cls.name in RENAMED:
        raise TypeError(
            f"rule {cls.__name__}: {cls.name!r} is the old name of {RENAMED[cls.name]}, "
            "which plans that name it load as; pick another name"
        )
    if not isinstance(cls.implementation, str) or not cls.implementation:
        raise TypeError(f"rule {cls.name}: implementation must be a word such as 'triton'")
    if cls.match is not Rule.match or "site" in inspect.signature(cls.rewrite).parameters:
        raise TypeError(
            f"rule {cls.name} defines match() or rewrite(gm, site): rules now name "
            "their anchors and define check(gm, node) and rewrite(gm, found) "
            "(see docs/writing-a-rule.md)"
        )
    for method in ("check", "rewrite"):
        if getattr(cls, method) is getattr(Rule, method):
            raise TypeError(f"rule {cls.name} does not define {method}()")
    if _origin_of(cls) != "opswap":
        _load_builtins()  # so a user's rule cannot take a built-in rule's name first
    held = type(_RULES[cls.name]) if cls.name in _RULES else cls
    # a module executed again (a file.py:function spec on every load, importlib.reload)
    # defines its rule classes anew: they replace themselves
    again = (held.__module__, held.__qualname__) == (cls.__module__, cls.__qualname__)
    if not again:
        raise TypeError(
            f"two rules are named {cls.name!r} (one from {_ORIGINS.get(cls.name, 'opswap')})"
        )
    _RULES[cls.name] = cls()
    _ORIGINS[cls.name] = _loading or _origin_of(cls)
    return cls


def _origin_of(cls: type[Rule]) -> str:
    if cls.__module__.startswith(__package__ + "."):
        return "opswap"
    return f"module {cls.__module__}"


def origin(name: str) -> str:
    """Where a rule came from: 'opswap' (built in), 'module mymodule' (imported by the user
    or with --rules-from) or 'entry point NAME of PACKAGE VERSION' (an installed package)."""
    _load()
    return _ORIGINS.get(name, "opswap")


def problems() -> list[str]:
    """One sentence for each installed plugin that was left out, and why."""
    _load()
    return list(_PROBLEMS)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    msg = text.splitlines()[0].rstrip(".") if text else ""  # the caller ends the sentence
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


@contextlib.contextmanager
def _registering(where: str) -> Iterator[None]:
    """Rules registered inside carry origin `where`; when the body raises, every rule it
    registered is taken out again, so a half-loaded plugin leaves nothing behind."""
    global _loading
    before, outer = set(_RULES), _loading
    _loading = where
    try:
        yield
    except BaseException:
        for name in set(_RULES) - before:
            del _RULES[name]
            _ORIGINS.pop(name, None)
        raise
    finally:
        _loading = outer


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    # entry_points(group=...) is Python >= 3.10, which opswap requires anyway
    return sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value)
    )


def _load_plugin(ep: importlib.metadata.EntryPoint) -> None:
    dist = getattr(ep, "dist", None)  # None for an EntryPoint built by hand
    source = f" of {dist.name} {dist.version}" if dist is not None else ""
    where = f"entry point {ep.name}{source}"
    try:
        with _registering(where):
            obj = ep.load()
            if isinstance(obj, type) and not any(type(r) is obj for r in _RULES.values()):
                register(obj)  # the entry point names a rule class it did not register
            # the module may have been imported (and its rules registered) before
            mine = [r for r in _RULES.values() if _comes_from(type(r), obj)]
            if not mine:
                raise TypeError(
                    "it registers no rule (decorate a Rule subclass with @opswap.rules.register)"
                )
            for r in mine:
                _ORIGINS[r.name] = where
    except Exception as e:  # any failure of third-party code: leave the plugin out, say so
        _PROBLEMS.append(
            f"The rule plugin {ep.name} ({ep.value}{source}) was left out: {_first_line(e)}."
        )


def load_module(name: str) -> list[Rule]:
    """Import a module of the user's (`mymodule`, `pkg.rules`, found on sys.path or in the
    current directory, or a path to a .py file) and return the rules it registers. Raises a
    RuleError in one sentence when it cannot be imported or registers no rule; then no rule
    of it stays registered."""
    _load()
    before = set(_RULES)
    try:
        with _registering(f"module {name}"):
            module = _import_user_module(name)
    except RuleError:
        raise
    except Exception as e:  # the user's code: its error, named, in one line
        raise RuleError(f"Could not load rules from {name!r}: {_first_line(e)}.") from None
    mine = [r for r in _RULES.values() if r.name not in before or _comes_from(type(r), module)]
    if not mine:
        raise RuleError(
            f"{name!r} registers no rule: decorate a subclass of "
            "opswap.rules.Rule with @opswap.rules.register in it."
        )
    return sorted(mine, key=lambda r: (r.chapter, r.name))


def _comes_from(cls: type, obj: object) -> bool:
    """Whether rule class `cls` is `obj` or is defined in module `obj` or a submodule of it."""
    if isinstance(obj, type):
        return cls is obj
    home = getattr(obj, "__name__", None)
    return home is not None and (cls.__module__ == home or cls.__module__.startswith(home + "."))


def _import_user_module(name: str) -> ModuleType:
    path = Path(name)
    if path.suffix == ".py":
        if not path.is_file():
            raise RuleError(f"Could not load rules from {name!r}: no such file.")
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
        key = f"_opswap_rules_{path.stem}_{digest}"  # one module per file, whatever its name
        if key in sys.modules:
            return sys.modules[key]
        spec = importlib.util.spec_from_file_location(key, path)
        # a path ending in .py always gets a spec with the source loader
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(key, None)
            raise
        return module
    # the `opswap` script does not put the current directory on sys.path, as `python -m` does
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise RuleError(
                f"Could not load rules from {name!r}: no module named {e.name!r} "
                f"on the Python path or in {cwd}."
            ) from None
        raise
    finally:
        if added:
            sys.path.remove(cwd)


def rule_modules() -> list[str]:
    """Dotted names of the modules that hold rules: the public modules of each family
    subpackage of opswap.rules, in name order."""
    package = __name__.rpartition(".")[0]  # this module's package, opswap.rules
    found = []
    for fam in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda m: m.name):
        if not fam.ispkg or fam.name.startswith("_"):
            continue
        family = importlib.import_module(f"{package}.{fam.name}")
        for mod in sorted(pkgutil.iter_modules(family.__path__), key=lambda m: m.name):
            if not mod.name.startswith("_"):
                found.append(f"{family.__name__}.{mod.name}")
    return found


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        for mod in rule_modules():
            importlib.import_module(mod)
        _loaded = True


def _load() -> None:
    """Import every rule module and then the installed plugins, on first use so that
    `import opswap` stays light."""
    global _plugins_loaded
    _load_builtins()
    if not _plugins_loaded:
        _plugins_loaded = True  # before loading: a plugin may itself ask the registry
        for ep in _entry_points():
            _load_plugin(ep)


def all_rules() -> list[Rule]:
    """All registered rules, sorted by chapter then name."""
    _load()
    return sorted(_RULES.values(), key=lambda r: (r.chapter, r.name))


def get(name: str) -> Rule:
    _load()
    try:
        return _RULES[current_name(name)]
    except KeyError:
        raise RuleError(
            f"No rule named {name!r}; `opswap rules` lists them ({', '.join(sorted(_RULES))}); "
            "a rule of your own module loads with --rules-from MODULE (the Python API: import "
            "the module)."
        ) from None


def parse_patterns(patterns: str | Iterable[str] | None) -> tuple[str, ...]:
    """Rule glob patterns from a comma-separated string ('fusion.*, layout.drop_*') or a
    list of them (each item may itself hold commas): stripped, empty items dropped, in
    the order given. None or nothing means every rule (an empty tuple)."""
    if patterns is None:
        return ()
    items = [patterns] if isinstance(patterns, str) else list(patterns)
    return tuple(p.strip() for item in items for p in str(item).split(",") if p.strip())


def select(
    patterns: str | Iterable[str] | None = None,
    exactness: str = "exact",
    target: str | None = None,
) -> list[Rule]:
    """Rules whose name matches one of the glob patterns (default: all), no looser than
    `exactness`, and expected to pay on `target` (None: any)."""
    _load()
    patterns = parse_patterns(patterns)
    if exactness not in EXACTNESS_ORDER:
        raise RuleError(f"exactness must be one of exact, approx, lossy; got {exactness!r}.")
    limit = EXACTNESS_ORDER[exactness]
    chosen = []
    for rule in all_rules():
        if patterns and not any(matches(rule.name, p) for p in patterns):
            continue
        if EXACTNESS_ORDER[rule.exactness] > limit:
            continue
        if target is not None and not rule.applies_to(target):
            continue
        chosen.append(rule)
    if patterns and not chosen:
        looser = sorted(
            {r.exactness for r in all_rules() if any(matches(r.name, p) for p in patterns)},
            key=EXACTNESS_ORDER.__getitem__,
        )
        if looser:
            raise RuleError(
                f"{','.join(patterns)} selects only {looser[0]} rules, which exactness "
                f"{exactness!r} leaves out; add --exactness {looser[0]} to plan them."
            )
        raise RuleError(
            f"No rule matches {','.join(patterns)!r} at exactness {exactness!r}; "
            "`opswap rules` lists them."
        )
    return chosen
