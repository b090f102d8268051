"""AOTInductor packages: a compiled winner saved compiled, so that loading it runs no
torch.compile.

When a compiled variant wins the race (`compile`, `opswap+compile`), model.pt2 holds the
graph it compiled, and `load_optimized` compiles it again at every load: seconds on a
CPU, tens of seconds on a GPU for a 1B-parameter model. `package` hands the very program
in model.pt2 to AOTInductor (`torch._inductor.aoti_compile_and_package`), which writes
the kernels Inductor generates and the C++ wrapper that calls them into
model_aoti.pt2; `AotiModule` loads that package (`aoti_load_package`: a shared library,
no tracing, no code generation) behind the same input check the lean loader of model.pt2
runs (backends.pt2: inputs by position or name, rank, dtype, fixed sizes and the
program's size guards), since the package's runner checks none of them. opswap's own ops
in the program run through AOTInductor's proxy executor, which calls them through the
dispatcher.

A program that holds opswap's static int8 sites is not packaged: the race compiles them
through Inductor's int8 lowering (kernels.int8_inductor), which AOTInductor does not run,
and a package would time and verify as another model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: the package's name beside model.pt2
PACKAGE = "model_aoti.pt2"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def package(pt2: Path, out: Path) -> tuple[Path | None, str | None]:
    """(path, None) once the program in `pt2` is compiled into the AOTInductor package
    `out`, or (None, why not) in one sentence; never raises."""
    from opswap.graph.copies import leafspec_quiet
    from opswap.kernels.int8_inductor import lower
    from opswap.models.checkpoint import program_module, read_program

    try:
        program = read_program(str(pt2))
        if lower(program_module(program))[1]:
            return None, (
                "no AOTInductor package: the model holds static int8 sites, which load "
                "compiles through Inductor's int8 lowering"
            )
        with leafspec_quiet():  # it copies the program: torch's LeafSpec warning, once a run
            made = torch._inductor.aoti_compile_and_package(program, package_path=str(out))
        return Path(made), None
    except Exception as e:  # AOTInductor can fail on any construct, or find no compiler
        Path(out).unlink(missing_ok=True)
        return None, f"no AOTInductor package: AOTInductor failed ({_first_line(e)})"


class AotiModule(nn.Module):
    """An AOTInductor package, loaded, behind the input check of the model.pt2 it was
    compiled from (`check`: backends.pt2's lean pre-hook, `(module, args, kwargs)` to
    None or the bound `(args, kwargs)`)."""

    def __init__(self, path: Path, check) -> None:
        super().__init__()
        self.path = Path(path)
        self._runner = torch._inductor.aoti_load_package(str(path))
        self._check = check

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._check(self, args, kwargs)
        if bound is not None:
            args, kwargs = bound
        return self._runner(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"AOTInductor package {self.path.name}"


def load(package_path: Path, pt2: Path) -> nn.Module | None:
    """The package at `package_path` behind model.pt2's input check, or None where that
    check cannot be had (a program whose guards opswap does not compile: torch's own guard
    function then stays, on the program's module, and the caller compiles that)."""
    from opswap.backends.pt2 import load as load_program

    check = getattr(load_program(pt2), "opswap_check", None)
    if check is None:
        return None
    return AotiModule(package_path, check)


def first_call_s(make, inputs: tuple) -> float:
    """Seconds from nothing to the first output: `make()` builds the callable (load, and a
    compile where it compiles), then one call on `inputs`."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        fn = make()
        fn(*inputs)
    return time.perf_counter() - t0
