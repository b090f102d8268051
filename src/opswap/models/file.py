"""`path/to/file.py:function`: a model defined in the user's own Python file.

Importing a file runs its code, so it happens only for a path the user named.
The function returns either `(module, example_inputs)` or a module alone; in the
latter case the file must also provide `example_inputs`, as a function or as a
tensor / tuple of tensors. Overrides are passed to the function (and to an
`example_inputs()` function) as keyword arguments it declares.
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

from opswap.errors import SpecError
from opswap.models._common import LoadedModel, as_input_tuple, unknown_key_error


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


def load_file(path: str, function: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """Import `path`, call `function`, and return its module with example inputs."""
    if not function.isidentifier():
        raise SpecError(f"'{function}' in {spec} is not a Python function name; write file.py:function.")
    user = _import_file(path)
    fn = getattr(user, function, None)
    if fn is None or not callable(fn):
        found = sorted(n for n, v in vars(user).items()
                       if inspect.isfunction(v) and not n.startswith("_") and v.__module__ == user.__name__)
        raise SpecError(
            f"{path} defines no function '{function}'"
            + (f"; it defines: {', '.join(found)}." if found else ".")
        )
    provider = getattr(user, "example_inputs", None)
    names, var_kw = _accepted(fn)
    if callable(provider):
        names |= _accepted(provider)[0]
    if not var_kw:
        for key in overrides:
            if key not in names:
                raise unknown_key_error(key, f"{spec} (the parameters of {function})", sorted(names))
    result = _call(fn, _kwargs_for(fn, overrides), f"{function}() in {path}")

    where = f"{function}() in {path}"
    if isinstance(result, nn.Module):
        module = result
        if provider is None:
            raise SpecError(
                f"{where} returned a module without inputs; return (module, example_inputs) or "
                f"define example_inputs (a function or a tuple of tensors) in {path}."
            )
        raw = _call(provider, _kwargs_for(provider, overrides), f"example_inputs() in {path}") \
            if callable(provider) else provider
        inputs = as_input_tuple(raw, f"example_inputs in {path}")
    elif isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], nn.Module):
        module = result[0]
        inputs = as_input_tuple(result[1], where)
    else:
        raise SpecError(
            f"{where} returned {type(result).__name__}; it must return an nn.Module or a "
            f"(module, example_inputs) tuple."
        )
    stem = os.path.splitext(os.path.basename(path))[0]
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    return LoadedModel(name=f"{stem}:{function}", spec=spec, source="file", module=module.eval(),
                       example_inputs=inputs, description=doc or f"{function}() from {path}",
                       settings=dict(overrides))
