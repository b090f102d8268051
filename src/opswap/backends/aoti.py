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

Loading a package can crash the process that loads it (a segmentation fault inside
`aoti_load_package`, seen with torch 2.11 on an H100, 2026-12-07, on a bf16 ResNet-50
packaged in the same process), and a crash is not an exception anyone can catch. So the
package is first loaded and run in a child Python (`first_call_in_child`, this module run
as a script): it loads the package as `load_optimized` would, in a fresh process, runs it
on the example and hands the outputs and the load-to-first-call time back; a child that
dies, hangs or raises leaves no package behind, and the run says why.

A program that holds opswap's static int8 sites is not packaged: the race compiles them
through Inductor's int8 lowering (backends.int8_inductor), which AOTInductor does not run,
and a package would time and verify as another model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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
    from opswap.backends.int8_inductor import lower
    from opswap.graph.copies import leafspec_quiet
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

    def __init__(
        self,
        path: Path,
        check: Callable[[nn.Module, tuple, dict[str, Any]], tuple[tuple, dict[str, Any]] | None],
    ) -> None:
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


def first_call_s(make: Callable[[], Callable[..., object]], inputs: tuple) -> float:
    """Seconds from nothing to the first output: `make()` builds the callable (load, and a
    compile where it compiles), then one call on `inputs`."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        fn = make()
        fn(*inputs)
    return time.perf_counter() - t0


#: seconds the child gets to load the package and run it once
CHILD_TIMEOUT_S = 600


def first_call_in_child(
    package_path: Path,
    pt2: Path,
    inputs: tuple,
    timeout_s: float = CHILD_TIMEOUT_S,
    python: str | None = None,
) -> tuple[Any, float]:
    """(outputs, seconds from nothing to the first output) of the package at `package_path`
    (behind model.pt2's input check) on `inputs`, loaded and run in a child Python, so that
    a crash while loading it cannot take this process down. Raises OpswapError with the
    child's end in one sentence (a signal, a timeout, its exception). `python`: the
    interpreter to run (this one by default)."""
    from opswap.errors import OpswapError

    root = str(Path(__file__).resolve().parents[2])  # the directory holding opswap
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    with tempfile.TemporaryDirectory(prefix="opswap_aoti_") as tmp:
        given, got = Path(tmp) / "inputs.pt", Path(tmp) / "outputs.pt"
        torch.save(tuple(inputs), given)
        try:
            proc = subprocess.run(
                [
                    python or sys.executable,
                    "-X",
                    "faulthandler",  # a crash prints the Python stack it happened under
                    "-m",
                    "opswap.backends.aoti",
                    str(package_path),
                    str(pt2),
                    str(given),
                    str(got),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as e:
            raise OpswapError(
                f"loading it and running it once took over {timeout_s:.0f} s in a fresh process"
            ) from e
        if proc.returncode != 0:
            if proc.returncode < 0:
                name = signal.Signals(-proc.returncode).name
                where = crash_frame(proc.stderr)
                raise OpswapError(
                    f"loading it in a fresh process crashed that process ({name}"
                    f"{', in ' + where if where else ''}) on torch {torch.__version__}"
                )
            last = (proc.stderr.strip().splitlines() or ["no message"])[-1][:300]
            raise OpswapError(f"loading it in a fresh process failed ({last})")
        found = torch.load(got, weights_only=False)
    return found["outputs"], float(found["first_call_s"])


def crash_frame(stderr: str) -> str | None:
    """The innermost Python frame of the stack faulthandler printed when the child crashed
    ("load_package, torch/_inductor/package/package.py:123"), or None when it printed none.
    faulthandler lists the frames innermost first, after "Fatal Python error" and the
    thread's header."""
    lines = stderr.splitlines()
    start = next((i for i, t in enumerate(lines) if t.startswith("Fatal Python error")), None)
    if start is None:
        return None
    for line in lines[start + 1 :]:
        t = line.strip()
        if t.startswith('File "') and " line " in t:
            path, _, rest = t[len('File "') :].partition('", line ')
            num, _, func = rest.partition(" in ")
            # from the package down when it is an installed one, else the last three parts
            short = path.rpartition("site-packages/")[2] if "site-packages/" in path else ""
            short = short or "/".join(Path(path).parts[-3:])
            return f"{func.strip() or '?'}, {short}:{num.strip()}"
    return None


def _child(argv: list[str]) -> None:
    """The child of `first_call_in_child`: load, run once, write the outputs and the time."""
    package_path, pt2, given, got = (Path(a) for a in argv)
    inputs = torch.load(given, weights_only=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        module = load(package_path, pt2)
        if module is None:
            raise SystemExit("model.pt2's guards cannot be checked in front of the package")
        outputs = module(*inputs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    took = time.perf_counter() - t0
    torch.save({"outputs": outputs, "first_call_s": took}, got)


if __name__ == "__main__":
    _child(sys.argv[1:])
