"""Size guards: the conditions on the input sizes under which a traced graph holds, compiled
once into one cheap input check, and carried from the capture to everything opswap makes.

A graph traced at one size holds only where the model would trace the same graph: a
branch on the length (`if x.shape[1] > 16`) is traced one way, and torch.export records
the condition it met as a guard (`seq >= 17`). opswap keeps the capture's guards
(`SizeGuard`, in graph.dynamic.Dynamic) and applies them wherever the graph goes: the
in-memory result refuses a call outside them (graph.dynamic.guard), a saved model.pt2
holds them as its own guards (backends.pt2 traces a check of each into the program), and
a file that cannot refuse a size (.onnx, OpenVINO's IR, .pte, a TVM library) keeps the
guarded axes static where the model computes something else outside the guard
(`SizeGuard.branch`).

The guards of a saved program, compiled once into one cheap input check:

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
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
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
    """The guards torch's `module()` checks, as expressions over the input leaves in
    placeholder order (x0, x1, ...: `leaf_names`), and each leaf as the user names it (`x`,
    or `pair[0]`, `batch['ids']` for a leaf inside a tuple or dict input); None where this
    torch does not say (torch < 2.9 has no `_guards_code`) or an input is not a tensor
    leaf of a named argument."""
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
    from torch.utils._pytree import keystr

    try:
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        sig = inspect.signature(module.forward)
        paths = paths_of(program.example_inputs, sig)
        if len(paths) != len(placeholders) or any(not p or not hasattr(p[0], "key") for p in paths):
            return None
        guards = list(input_guards(placeholders, program.range_constraints, paths))
        guards += gm_match(ep_match(list(code), paths), sig)
    except Exception:  # private helpers whose signatures move between releases
        return None
    # `L['pair'][1]` is a prefix of `L['pair'][10]`: the longest sources are renamed first
    sources = sorted(((f"L{keystr(p)}", i) for i, p in enumerate(paths)), key=lambda t: -len(t[0]))
    renamed = []
    for g in guards:
        for source, i in sources:
            g = g.replace(source, f"x{i}")
        renamed.append(g)
    return renamed, [str(p[0].key) + keystr(p[1:]) for p in paths]


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


def refusal(name: str, args: tuple, names: list[str], each, labels: list[str] | None = None) -> str:
    """The sentence that says which guard a call broke, naming the sizes it was given;
    `args` are the leaves `names` (the guards' variables) stand for, `labels` how the user
    names them (default: `names`)."""
    labels = labels or names
    for shown, ok in each:
        if ok(*args):
            continue
        given = []
        for arg, dim in dict.fromkeys(_SIZE.findall(shown)):
            x = args[names.index(arg)] if arg in names else None
            if isinstance(x, torch.Tensor) and int(dim) < x.dim():
                given.append(
                    f"input {labels[names.index(arg)]} has size {x.shape[int(dim)]} in dim {dim}"
                )
        what = " and ".join(given) or "the inputs' sizes"
        told = _SIZE.sub(
            lambda m: f"{labels[names.index(m[1])]}.size()[{m[2]}]" if m[1] in names else m[0],
            shown,
        )
        return f"{name}: {what}, but the saved program accepts only {told}."
    return f"{name}: the inputs break one of the program's guards."


#: a guard's reference to an input leaf's size, as opswap writes its guards: `x0.size()[1]`
_LEAF_SIZE = re.compile(r"\bx(\d+)\.size\(\)\[(\d+)\]")


@dataclass(frozen=True)
class SizeGuard:
    """One condition on the input sizes the captured graph holds under, written over the
    flattened input leaves (`x0.size()[1] >= 17`). `branch` is True when the model itself
    runs at a size the condition excludes (it takes another path there, so the graph would
    answer wrongly), False when it refuses such a size too (the guard only restates the
    model's own limit), None when no size the capture claims breaks it (a relation between
    dims that move together as one axis)."""

    code: str
    branch: bool | None = None

    @property
    def dims(self) -> tuple[tuple[int, int], ...]:
        """The (input leaf, dim) sizes the condition reads."""
        return tuple(dict.fromkeys((int(i), int(d)) for i, d in _LEAF_SIZE.findall(self.code)))

    def describe(self, names: list[str] | None = None) -> str:
        """The condition in the user's names: `dim 1 of x >= 17`."""

        def name(m: re.Match) -> str:
            i, d = int(m[1]), int(m[2])
            who = names[i] if names is not None and i < len(names) else f"input {i}"
            return f"dim {d} of {who}"

        return _LEAF_SIZE.sub(name, self.code)

    def to_json(self) -> dict[str, Any]:
        return {"guard": self.code, "branch": self.branch}


class Sizes:
    """A stand-in for a tensor of shape `shape` that a compiled guard can read sizes from,
    so that a condition is evaluated at sizes no tensor was made for."""

    def __init__(self, shape) -> None:
        self.shape = torch.Size(shape)

    def size(self) -> torch.Size:
        return self.shape

    def stride(self) -> tuple[int, ...]:
        """The strides of a contiguous tensor of this shape (a guard may read them: the
        inputs opswap makes at other sizes are contiguous)."""
        out, step = [], 1
        for n in reversed(self.shape):
            out.append(step)
            step *= max(int(n), 1)
        return tuple(reversed(out))


def leaf_labels(inputs: tuple, params: list[str] | None = None) -> list[str]:
    """Each tensor or number leaf of a call's positional `inputs` as the user names it: the
    parameter's name (`params`, else its position), then where the leaf sits inside a tuple
    or dict input: `x`, `pair[0]`, `batch['ids']`, `1[0]`."""
    from torch.utils._pytree import SequenceKey, keystr, tree_leaves_with_path

    out = []
    for path, _ in tree_leaves_with_path(list(inputs)):
        first = path[0]
        i = first.idx if isinstance(first, SequenceKey) else 0
        out.append((params[i] if params and i < len(params) else str(i)) + keystr(path[1:]))
    return out


def leaf_names(n: int) -> list[str]:
    """The names opswap's guards give the input leaves: x0, x1, ..."""
    return [f"x{i}" for i in range(n)]


def checker(guards: list[SizeGuard], n_leaves: int):
    """(holds, each) for `guards` over `n_leaves` leaves (see `compile_guards`): holds(*leaves)
    is True when every guard does; None when there is no guard (or one is not plain size
    arithmetic, which the capture never keeps)."""
    if not guards:
        return None
    compiled = compile_guards([g.code for g in guards], leaf_names(n_leaves))
    if compiled is None or compiled[0] is None:
        return None
    return compiled


def program_guards(program, module: torch.fx.GraphModule, n_leaves: int) -> list[str]:
    """The size guards of `program` (torch.export of a model at its example inputs, whose
    user inputs are `n_leaves` tensors), over the leaves as x0, x1, ...: torch's own list
    (`guards_code`) renamed, without the sizes the program holds fixed; from the range of
    each input dim's symbol where torch does not say (nested inputs, an older torch). Only
    guards that are plain size arithmetic are kept."""
    found = guards_code(program, module)
    out: list[str] = []
    if found is not None and len(found[1]) == n_leaves:
        out = found[0]
    else:
        out = _range_guards(program)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    fixed = frozenset(
        f"x{i}.size()[{d}] == {s}"
        for i, n in enumerate(placeholders)
        if isinstance(n.meta.get("val"), torch.Tensor)
        for d, s in enumerate(n.meta["val"].shape)
        if isinstance(s, int)
    )
    compiled = compile_guards(out, leaf_names(n_leaves), fixed)
    return [text for text, _ in compiled[1]] if compiled is not None else []


def _range_guards(program) -> list[str]:
    """`x{i}.size()[d] >= lo` / `<= hi` for each user input dim whose symbol's range is
    narrower than torch's default (a lower bound above 2, a finite upper bound)."""
    import sympy

    users = set(program.graph_signature.user_inputs)
    vals = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"]
    names = [n.name for n in program.graph.nodes if n.op == "placeholder"]
    out = []
    leaf = 0
    for name, val in zip(names, vals, strict=True):
        if name not in users:
            continue
        if isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                expr = getattr(getattr(s, "node", None), "expr", None)
                rng = (
                    program.range_constraints.get(expr) if isinstance(expr, sympy.Symbol) else None
                )
                if rng is None:
                    continue
                lo, hi = rng.lower, rng.upper
                if lo.is_finite and int(lo) > 2:
                    out.append(f"x{leaf}.size()[{d}] >= {int(lo)}")
                if hi.is_finite:
                    out.append(f"x{leaf}.size()[{d}] <= {int(hi)}")
        leaf += 1
    return out


@functools.lru_cache(maxsize=64)
def _compiled(codes: tuple[str, ...], n: int) -> tuple[tuple[str, Callable[..., Any]], ...]:
    found = compile_guards(list(codes), leaf_names(n))
    return tuple(found[1]) if found is not None else ()


def check_sizes(inputs: tuple, codes: tuple[str, ...]) -> None:
    """Check that the leaves of `inputs` meet every guard in `codes` (over x0, x1, ...), as
    torch._check: traced by torch.export with symbolic sizes, each becomes a guard of the
    program (a range of the size's symbol, or a check the program runs), so a program
    exported from a graph that holds only under the capture's guards keeps them
    (backends.pt2._checked puts a call of this at the top of the graph it exports)."""
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves(list(inputs))
    for text, holds in _compiled(tuple(codes), len(leaves)):
        torch._check(holds(*leaves), lambda text=text: f"the inputs break the size guard {text}")
