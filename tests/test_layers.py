"""The packages stay in layers, and no modules import each other in a circle.

Every module of src/opswap is read with `ast` (no import is run), and every import in
it counts: at the top, inside functions, in try blocks, under `if TYPE_CHECKING:`, and an
`importlib.import_module("opswap.x")` with the name written out. A module may import
from its own layer or from one below; `LAYERS` lists them from the bottom, with no
exceptions. An import for the type checker counts like any other: two files that name
each other's types are one idea split in two, and a circle of files is a circle whether
or not Python runs it.

kernels sit under graph (they import nothing of opswap's, and models.checkpoint loads
them); backends sit above verify and under bench, which times what they export; config
(a run's settings) sits above bench, whose names it checks, and under everything that
reads a run's settings. A new top-level package or module must be given its place in
`LAYERS`.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: from the bottom; each entry names the top-level modules of opswap in one layer ("" is
#: the package's own __init__, the public surface beside the API functions it re-exports)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("floor", ("errors", "_callable", "_version")),
    ("targets", ("targets",)),
    ("kernels", ("kernels",)),
    ("graph", ("graph",)),
    ("models", ("models",)),
    ("cost", ("cost",)),
    ("rules", ("rules",)),
    ("tuning", ("tuning",)),
    ("planner", ("planner",)),
    ("verify", ("verify",)),
    ("backends", ("backends",)),
    ("bench", ("bench",)),
    ("config", ("config",)),
    ("report", ("report",)),
    ("onnx", ("onnx",)),
    ("artifact", ("record", "artifact", "result")),
    ("llm", ("llm",)),
    ("pipeline", ("pipeline", "stages")),
    ("api", ("api", "deploy", "train", "catalog", "")),
    ("cli", ("cli",)),
]


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of opswap (a package by its __init__)."""
    out = {}
    for path in sorted((SRC / "opswap").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported opswap module, line) for every import of `name`, those for the type checker
    included: `from a.b import c` names the module a.b.c when there is one, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def target(base: str, names: list[str], line: int) -> None:
        if base != "opswap" and not base.startswith("opswap."):
            return
        for n in names:
            found.append((f"{base}.{n}" if f"{base}.{n}" in MODULES else base, line))

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend(
                (a.name, node.lineno)
                for a in node.names
                if a.name == "opswap" or a.name.startswith("opswap.")
            )
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        ):
            named = node.args[0].value  # importlib.import_module("opswap.x")
            if named == "opswap" or named.startswith("opswap."):
                found.append((named, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            target(base, [a.name for a in node.names], node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def layer_of(module: str) -> tuple[int, str]:
    """(index from the bottom, name) of the layer that holds `module`."""
    top = module.split(".")[1] if "." in module else ""
    for i, (layer, members) in enumerate(LAYERS):
        if top in members:
            return i, layer
    raise AssertionError(
        f"{module} is in no layer: give opswap.{top} its place in tests/test_layers.py's LAYERS"
    )


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_from_a_layer_above_its_own():
    wrong = []
    for module, imports in IMPORTS.items():
        here, here_name = layer_of(module)
        for imported, line in imports:
            there, there_name = layer_of(imported)
            if there > here:
                wrong.append(
                    f"{module} (layer {here_name}) imports {imported} (layer "
                    f"{there_name}, above it) at line {line}"
                )
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules
    that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in graph[v]:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_modules_import_each_other_in_a_circle():
    graph = {m: {i for i, _ in imports if i in MODULES} for m, imports in IMPORTS.items()}
    cycles = _cycles(graph)
    described = []
    for part in cycles:
        edges = [f"{a} -> {b}" for a in part for b in sorted(graph[a]) if b in part]
        described.append(", ".join(edges))
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(described)


def test_the_reader_sees_imports_inside_functions_and_for_the_type_checker(tmp_path):
    code = (
        "from typing import TYPE_CHECKING\n"
        "from opswap.errors import OpswapError\n"
        "if TYPE_CHECKING:\n"
        "    from opswap.api import optimize\n"
        "def f():\n"
        "    import opswap.graph.ops\n"
        "    from opswap.rules import registry\n"
        "    return importlib.import_module('opswap.verify.outputs')\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(code)
    got = {m for m, _ in _imports("opswap.targets.probe", path)}
    assert got == {
        "opswap.errors",
        "opswap.api",
        "opswap.graph.ops",
        "opswap.rules.registry",
        "opswap.verify.outputs",
    }
