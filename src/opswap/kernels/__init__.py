"""Custom kernels registered as torch ops (`torch.ops.opswap.*`), one per file beside its
reference implementation. Importing this package registers them, which is what loading
a saved `model.pt2` that uses them needs (`opswap.load_optimized` does it).

The kernels are found, not listed: every module here whose name does not start with `_`
is a kernel and is imported, in name order (crossover, the measured table the kernels
consult, aside). A new kernel is a new file (docs/kernels-and-lowerings.md).
"""

import importlib
import pkgutil

#: the modules that are not kernels
_NOT_KERNELS = ("crossover",)

__all__ = [
    m.name
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
    if not m.name.startswith("_") and m.name not in _NOT_KERNELS
]

for _name in __all__:
    importlib.import_module(f"{__name__}.{_name}")
