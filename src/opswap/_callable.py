"""Packages that are also the API function of the same name.

DESIGN names `opswap.verify` and `opswap.bench` both as subpackages and as public
functions. A plain function bound on `opswap` would be replaced (or break
`import opswap.verify.x as y`) once Python binds the subpackage onto its parent;
a module whose class defines `__call__` is both, with no import-order tricks.
"""

from __future__ import annotations

import types
from collections.abc import Callable


def make_callable(package: types.ModuleType, function: Callable) -> None:
    """Let `package(...)` call `function(...)`. The root package does this for
    opswap.verify and opswap.bench once it has the API functions: a package stays below
    the API it is called as."""

    class _CallablePackage(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    _CallablePackage.__name__ = f"{package.__name__.rsplit('.', 1)[-1]}_package"
    package.__class__ = _CallablePackage
