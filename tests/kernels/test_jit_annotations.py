"""A compiling Triton reads a kernel's annotations (the interpreter does not): `x: Any` on
a runtime argument is looked up as a global and the build fails on the GPU only, as
Winograd's products did on an H100 (2026-12-07). So every kernel function in
src/opswap (one with a `tl.constexpr` argument) annotates its other arguments with a
Triton type or not at all."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "opswap"


def _kernel_annotations(tree: ast.AST) -> list[tuple[str, str, str]]:
    """(function, argument, annotation) of every runtime argument annotated with anything
    but a Triton type, in functions that take a tl.constexpr argument."""
    bad = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        notes = {a.arg: ast.unparse(a.annotation) for a in args if a.annotation is not None}
        if not any(n.endswith("constexpr") for n in notes.values()):
            continue
        for name, note in notes.items():
            if not (note.endswith("constexpr") or note.startswith("tl.")):
                bad.append((fn.name, name, note))
    return bad


def test_kernel_arguments_carry_no_annotation_a_compiling_triton_cannot_resolve() -> None:
    found = {
        str(p.relative_to(SRC)): bad
        for p in sorted(SRC.rglob("*.py"))
        if (bad := _kernel_annotations(ast.parse(p.read_text())))
    }
    assert not found, found


def test_the_check_sees_an_annotation_that_broke_the_build() -> None:
    src = "def k(x_ptr: Any, n, B: tl.constexpr) -> None:\n    pass\n"
    assert _kernel_annotations(ast.parse(src)) == [("k", "x_ptr", "Any")]
    ok = "def k(x_ptr, n: tl.int32, B: tl.constexpr):\n    pass\n"
    assert _kernel_annotations(ast.parse(ok)) == []
