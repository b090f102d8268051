"""Packages that are also the API function of the same name.

DESIGN names `opswap.verify` and `opswap.bench` both as subpackages and as public
functions. A plain function bound on `opswap` would be replaced (or break
`import opswap.verify.x as y`) once Python binds the subpackage onto its parent;
a module whose class defines `__call__` is both, with no import-order tricks.
"""

from __future__ import annotations

import importlib
import sys
import types


def make_callable(package: str, api_function: str) -> None:
    """Let `package(...)` call `opswap.api.<api_function>(...)`."""
    module = sys.modules[package]

    class _CallablePackage(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(importlib.import_module("opswap.api"), api_function)(*args, **kwargs)

    _CallablePackage.__name__ = f"{package.rsplit('.', 1)[-1]}_package"
    module.__class__ = _CallablePackage
