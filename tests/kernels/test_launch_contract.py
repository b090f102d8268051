"""What every Triton kernel of opswap must keep for torch.compile to take it.

Under torch.compile, inductor re-binds a `wrap_triton` launch by the kernel's parameter
names and drops any default: a constexpr left to its default reaches the compiled kernel
missing ("Incorrect number of arguments passed to kernel"), which the interpreter never
shows. So no kernel declares a default, and a launch that forgets a flag fails here, in
the interpreter, as it would under compile on a GPU.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import opswap.kernels as kernels  # noqa: E402


def _kernel_functions() -> list[tuple[str, object]]:
    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"opswap.kernels.{info.name}")
        for name, fn in vars(module).items():
            if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            params = inspect.signature(fn).parameters.values()
            if any(p.annotation in (tl.constexpr, "tl.constexpr") for p in params):
                found.append((f"{info.name}.{name}", fn))
    return found


KERNELS = _kernel_functions()


def test_the_kernels_are_found():
    names = {n.split(".")[0] for n, _ in KERNELS}
    assert {
        "decode_attention",
        "_flash_fwd",
        "_flash_bwd",
        "softmax",
        "rms_norm",
        "group_norm",
        "activation",
    } <= names


@pytest.mark.parametrize("name,fn", KERNELS, ids=[n for n, _ in KERNELS])
def test_no_constexpr_has_a_default(name, fn):
    defaults = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is not inspect.Parameter.empty
    ]
    assert not defaults, f"{name}: pass {defaults} at every launch instead of defaulting them"


@pytest.mark.parametrize("name,fn", KERNELS, ids=[n for n, _ in KERNELS])
def test_constexpr_globals_survive_inductors_copy(name, fn):
    """Inductor pastes a kernel's constexpr globals into its own source by repr; a value
    whose repr is no Python literal (-inf is written `inf`) breaks the compiled model."""
    for g in fn.__code__.co_names:
        value = fn.__globals__.get(g)
        if isinstance(value, tl.constexpr):
            text = repr(value.value)
            assert eval(text, {}) == value.value, f"{name}: global {g} is written {text}"
