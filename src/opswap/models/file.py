"""`path/to/file.py:function`: a model defined in the user's own Python file.

Importing a file runs its code, so it happens only for a path the user named.
The function returns `(module, example_inputs)`, `(module, args, kwargs)`,
`(module, kwargs)` or a module alone; in the last case the file must also
provide `example_inputs`, as a function or a value. Example inputs are a tensor,
a tuple of tensors (forward's positional arguments), a dict of keyword inputs or
an `(args, kwargs)` pair. A model that takes keywords is wrapped in a
graph.keywords.KeywordCall, which takes the tensors positionally (the positional
ones first, then the keyword ones in the order given) and binds the non-tensor
values as constants; `settings["inputs"]` records that order. Overrides are
passed to the function (and to an `example_inputs()` function) as the keyword
arguments it declares.

A file may also define `calibration` (a function, called with the overrides it
declares, or a value): the batches static int8 calibrates on, in any form
graph.calibration_data reads (a list of input batches, one tensor of stacked samples,
or a file's path). It is only called when a plan needs calibration.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from types import ModuleType
from typing import Any

from torch import nn

from opswap.errors import OpswapError, SpecError
from opswap.graph.keywords import KeywordCall, has_constants, split_inputs
from opswap.models._common import (
    CalibrationSource,
    LoadedModel,
    as_input_tuple,
    builder_defaults,
    unknown_key_error,
)


def _import_file(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise SpecError(f"Model file {path} does not exist; check the path before ':function'.")
    abspath = os.path.abspath(path)
    digest = hashlib.sha1(abspath.encode()).hexdigest()[:10]
    stem = os.path.splitext(os.path.basename(path))[0]
    mod_name = f"_opswap_user_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(mod_name, abspath)
    if spec is None or spec.loader is None:
        raise SpecError(f"Python cannot import {path}; is it a .py file?")
    module = importlib.util.module_from_spec(spec)
    # Registered so that pickling/dataclasses inside the file can find their module.
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise SpecError(f"Importing {path} failed with {type(e).__name__}: {e}") from e
    return module


def _accepted(fn) -> tuple[set[str], bool]:
    """Keyword parameter names of fn, and whether it takes **kwargs."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def _kwargs_for(fn, overrides: dict[str, Any]) -> dict[str, Any]:
    names, var_kw = _accepted(fn)
    return dict(overrides) if var_kw else {k: v for k, v in overrides.items() if k in names}


def _call(fn, kwargs: dict[str, Any], what: str):
    try:
        return fn(**kwargs)
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(f"{what} raised {type(e).__name__}: {e}") from e


def _with_inputs(module: nn.Module, raw: Any, where: str) -> tuple[nn.Module, tuple]:
    """The module (wrapped when the inputs hold keywords) and its positional inputs."""
    split = split_inputs(raw)
    if split is None and has_constants(raw):  # (x, True, 2.0): the constants are bound
        split = (tuple(raw), {})
    if split is None or (split[0] and not split[1] and not has_constants(split[0])):
        return module, as_input_tuple(raw if split is None else split[0], where)
    try:
        return KeywordCall.wrap(module, *split, where=where)
    except SpecError:
        raise
    except OpswapError as e:
        raise SpecError(str(e)) from e


def load_file(path: str, function: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """Import `path`, call `function`, and return its module with example inputs."""
    if not function.isidentifier():
        raise SpecError(
            f"'{function}' in {spec} is not a Python function name; write file.py:function."
        )
    user = _import_file(path)
    fn = getattr(user, function, None)
    if fn is None or not callable(fn):
        found = sorted(
            n
            for n, v in vars(user).items()
            if inspect.isfunction(v) and not n.startswith("_") and v.__module__ == user.__name__
        )
        raise SpecError(
            f"{path} defines no function '{function}'"
            + (f"; it defines: {', '.join(found)}." if found else ".")
        )
    provider = getattr(user, "example_inputs", None)
    calibration = getattr(user, "calibration", None)
    names, var_kw = _accepted(fn)
    for other in (provider, calibration):
        if callable(other):
            names |= _accepted(other)[0]
    if not var_kw:
        for key in overrides:
            if key not in names:
                raise unknown_key_error(
                    key, f"{spec} (the parameters of {function})", sorted(names)
                )
    result = _call(fn, _kwargs_for(fn, overrides), f"{function}() in {path}")

    where = f"{function}() in {path}"
    if isinstance(result, nn.Module):
        module = result
        if provider is None:
            raise SpecError(
                f"{where} returned a module without inputs; return (module, example_inputs) or "
                f"define example_inputs (a function or a tuple of tensors) in {path}."
            )
        raw = (
            _call(provider, _kwargs_for(provider, overrides), f"example_inputs() in {path}")
            if callable(provider)
            else provider
        )
        wrapped, inputs = _with_inputs(module, raw, f"example_inputs in {path}")
    elif (
        isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], nn.Module)
    ):
        module = result[0]
        wrapped, inputs = _with_inputs(module, result[1], where)
    elif (
        isinstance(result, (tuple, list))
        and len(result) == 3
        and isinstance(result[0], nn.Module)
        and isinstance(result[2], dict)
    ):
        module, args = result[0], result[1]
        args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
        wrapped, inputs = _with_inputs(module, (args, result[2]), where)
    else:
        raise SpecError(
            f"{where} returned {type(result).__name__}; it must return an nn.Module, "
            f"(module, example_inputs) or (module, args, kwargs)."
        )
    was_training = module.training
    module.eval()  # a spec is loaded for inference, as every other source's model is
    wrapped.training = False
    settings = {k: v for k, v in builder_defaults(fn).items() if k in names}
    if was_training:
        settings["mode"] = (
            "eval: the function returned a module in training mode, and "
            "opswap loads every spec for inference"
        )
    settings.update(overrides)
    if isinstance(wrapped, KeywordCall):
        settings["inputs"] = wrapped.order
        if wrapped.bound:
            settings["constants"] = dict(wrapped.bound)
    stem = os.path.splitext(os.path.basename(path))[0]
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    return LoadedModel(
        name=f"{stem}:{function}",
        spec=spec,
        source="file",
        module=wrapped,
        example_inputs=inputs,
        description=doc or f"{function}() from {path}",
        settings=settings,
        calibration=_calibration(calibration, overrides, path),
    )


def _calibration(provider: Any, overrides: dict[str, Any], path: str) -> CalibrationSource | None:
    """The file's `calibration` (a function or a value) as a source read when needed."""
    if provider is None:
        return None
    name = os.path.basename(path)
    if not callable(provider):
        return CalibrationSource(lambda: provider, f"calibration in {name}")
    where = f"calibration() in {name}"
    return CalibrationSource(
        lambda: _call(provider, _kwargs_for(provider, overrides), f"calibration() in {path}"),
        where,
    )
