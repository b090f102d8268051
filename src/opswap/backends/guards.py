"""The guards of a saved program, compiled once into one cheap input check.

`ExportedProgram.module()` checks every call against the program's guards: the size
ranges and relations in `range_constraints` and the conditions the tracer met in the
code (`_guards_code`, e.g. `L['ids'].size()[1] > 16` for a branch on the length). A
program answers wrongly outside them (the other branch was never traced), so the lean
loader keeps them, but as one generated Python function (a few comparisons,
about a microsecond) instead of torch's `_guards_fn` submodule (~50 µs a call).

The list of guards is composed as torch's own guard function composes it
(torch.export._unlift, torch >= 2.9), hence exactly as permissive: a lower bound of 2
that torch sets on a dynamic dim only for its 0/1 specialisation is not checked,
so batch 1, where opswap verifies the saved file, runs. The expressions come from
the file, so each is parsed and allowed only if it is arithmetic and comparisons over
the inputs' sizes; anything else, or a torch without these helpers, gives None and
the caller keeps torch's own guard function.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from typing import Any, cast

import torch

# sympy's printed functions that can appear in a guard; pure functions of ints
_CALLS = {
    "math": {"floor", "ceil", "trunc", "sqrt"},
    "torch": {"sym_max", "sym_min", "sym_float", "sym_int", "sym_sqrt", "sym_not", "sym_ite"},
}
_NAMES = {"IsNonOverlappingAndDenseIndicator", "cast_symbool_to_symint_guardless"}
_NODES = (
    ast.Expression,
    ast.Compare,
    ast.BoolOp,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Load,
    ast.And,
    ast.Or,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Name,
    ast.Call,
    ast.Attribute,
    ast.Subscript,
    ast.Tuple,
)
_SIZE = re.compile(r"(\w+)\.size\(\)\[(\d+)\]")


def guards_code(program, module: torch.fx.GraphModule) -> tuple[list[str], list[str]] | None:
    """The guards torch's `module()` checks, as expressions over `L['name']`, and the input
    names in placeholder order; None where this torch does not say (torch < 2.9 has no
    `_guards_code`) or the inputs are not plain positional tensors."""
    try:
        import torch.export._unlift as unlift
    except ImportError:
        return None
    helpers = [
        getattr(unlift, n, None)
        for n in (
            "_get_input_paths",
            "_get_input_guards_for_graph",
            "_force_ep_signature_match",
            "_force_gm_signature_match",
        )
    ]
    code = getattr(program, "_guards_code", None)
    if code is None or not all(helpers) or not program.example_inputs:
        return None
    paths_of, input_guards, ep_match, gm_match = cast(list[Callable[..., Any]], helpers)
    try:
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        sig = inspect.signature(module.forward)
        paths = paths_of(program.example_inputs, sig)
        if len(paths) != len(placeholders) or any(
            len(p) != 1 or not hasattr(p[0], "key") for p in paths
        ):
            return None
        guards = list(input_guards(placeholders, program.range_constraints, paths))
        guards += gm_match(ep_match(list(code), paths), sig)
    except Exception:  # private helpers whose signatures move between releases
        return None
    return guards, [str(p[0].key) for p in paths]


def _allowed(tree: ast.AST, inputs: set[str]) -> bool:
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            return False
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float | bool):
            return False
        if isinstance(node, ast.Name) and node.id not in inputs | _NAMES | set(_CALLS):
            return False
        if isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if not (
                base in inputs
                and node.attr in ("size", "stride")
                or base in _CALLS
                and node.attr in _CALLS[base]
            ):
                return False
        if isinstance(node, ast.Call):
            f = node.func
            if node.keywords or not (
                isinstance(f, ast.Name) and f.id in _NAMES or isinstance(f, ast.Attribute)
            ):
                return False
    return True


def compile_guards(
    guards: list[str], names: list[str], known: frozenset[str] = frozenset()
) -> tuple[Callable[..., bool] | None, list[tuple[str, Callable[..., bool]]]] | None:
    """One function of the inputs (positionally) that is True when every guard holds (None
    when there is none to check), and each guard (as written over the input names) with
    its own predicate, to say which failed; None when a guard is not plain size
    arithmetic. Guards in `known` (as written, e.g. `x.size()[1] == 8`, the fixed sizes
    the caller checks itself) are left out."""
    import math

    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    inputs = set(names)
    shown = []
    for g in guards:
        for name in names:
            g = g.replace(f"L['{name}']", name)
        try:
            tree = ast.parse(g, mode="eval")
        except SyntaxError:
            return None
        if "L[" in g or not _allowed(tree, inputs):
            return None
        text = ast.unparse(tree)
        if text not in known and text not in shown:
            shown.append(text)
    namespace: dict[str, Any] = {k: SYMPY_INTERP[k] for k in _NAMES if k in SYMPY_INTERP}
    namespace.update(math=math, torch=torch)
    params = ", ".join(names)
    each: list[tuple[str, Callable[..., bool]]] = []
    if not shown:
        return None, each
    body = " and ".join(f"({s})" for s in shown)
    exec(f"def _all({params}):\n    return {body}\n", namespace)  # noqa: S102 (checked above)
    for s in shown:
        exec(f"def _one({params}):\n    return {s}\n", namespace)  # noqa: S102
        each.append((s, namespace["_one"]))
    return namespace["_all"], each


def refusal(name: str, args: tuple, names: list[str], each) -> str:
    """The sentence that says which guard a call broke, naming the sizes it was given."""
    for shown, ok in each:
        if ok(*args):
            continue
        given = []
        for arg, dim in dict.fromkeys(_SIZE.findall(shown)):
            x = args[names.index(arg)] if arg in names else None
            if isinstance(x, torch.Tensor) and int(dim) < x.dim():
                given.append(f"input {arg} has size {x.shape[int(dim)]} in dim {dim}")
        what = " and ".join(given) or "the inputs' sizes"
        return f"{name}: {what}, but the saved program accepts only {shown}."
    return f"{name}: the inputs break one of the program's guards."
