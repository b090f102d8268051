"""The saved artifact: a torch.export program written to `model.pt2`, reloaded, and timed.

What a user deploys is the file, not the module opswap holds in memory, and the two
can differ: torch.export traces through Python modules and keeps only registered
ops, so a module that picks a fused kernel in its forward would be saved as the
plain ops. So the race times the program reloaded from the file it will save
(`export_artifact`), and `artifact.save` copies that very file.

Loading runs no pickled code (models.checkpoint's checks) and needs `import opswap`
first, which registers opswap's own ops (`torch.ops.opswap.*`).

Why the loaded module is trimmed: `ExportedProgram.module()` calls a `_guards_fn`
at the start of every forward, Python code that re-checks the input shapes
against sympy expressions, and a pre-hook matches the inputs' pytree against the
exported one. Measured on the 2-core CPU (torch 2.13), a one-Linear model whose
eager forward takes 9 µs: 68 µs per call as loaded, 50 µs of it the guard
function and most of the rest the pre-hook (`module(check_guards=False)` moves
similar checks into a pre-hook that cost 100 µs). `load` builds the module without
both and checks instead what a wrong input would break: the number of inputs
(positional or by their recorded names), each one's rank and dtype, every size the
program was not exported dynamic in, and every range and relation the program's
guards hold (graph.guards compiles them once into one function; a branch on the
length traced at 32 is refused at 8 instead of answering with the other branch).
The check costs about a microsecond: on the same one-Linear model, timed with the
machine shared (every figure ~5x the quiet one), the pre-hook took 8.4 µs before the
guards were kept and 9.4 µs after. Where this torch does not say what its guards are
(before 2.9) or one is not plain size arithmetic, torch's own guard function stays,
behind the same check of the inputs, and a guard it finds broken is refused in one
sentence (InputError) rather than torch's `AssertionError: Guard failed`. A tuple or dict
input is checked leaf by leaf and named as the user wrote it (`pair[0]`, `batch['ids']`).
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from opswap.graph.dynamic import Axis, Dynamic

    #: what `export` returns: (program, note, the axes the program keeps dynamic)
    Exported = tuple[ExportedProgram, str | None, Dynamic]
    #: what graph.guards.compile_guards returns: (all guards, each guard with its own)
    Guards = tuple[Callable[..., bool] | None, list[tuple[str, Callable[..., bool]]]]
    #: torch.export's dynamic_shapes argument
    Shapes = dict[str, Any] | tuple[Any, ...] | list[Any] | None


@dataclass
class Artifact:
    """A model exported to `path` and reloaded from it (`module`), or why it could not be.
    `note` says what the file cannot do (e.g. accept other shapes); `kept` is the
    graph.dynamic.Dynamic of the axes the file really keeps dynamic (None: not exported)."""

    path: Path | None
    module: nn.Module | None
    note: str | None = None
    error: str | None = None
    kept: Any = None
    exported: Any = None  # (program, note, kept) of export(), kept for an ONNX export of it

    @property
    def ok(self) -> bool:
        return self.module is not None

    def copy_to(self, dest: Path) -> Path:
        dest = Path(dest)
        if self.path is None:
            raise FileNotFoundError("no artifact was written")
        if self.path.resolve() != dest.resolve():
            shutil.copyfile(self.path, dest)
        return dest


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _specialised(ep: ExportedProgram, inputs: tuple, dynamic: Dynamic) -> list[Axis]:
    """The axes of `dynamic` that the program holds at a fixed size after all: Dim.AUTO
    lets torch.export specialise a dim it cannot keep symbolic (an nn.LSTM's time steps)
    without a word."""
    from torch.utils import _pytree as pytree

    users = set(ep.graph_signature.user_inputs)
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder" and n.name in users]
    leaves = pytree.tree_leaves(list(inputs))
    if len(vals) != len(leaves):
        return []

    def fixed(n: int | torch.SymInt) -> bool:  # an int, or a SymInt whose expression is a number
        if isinstance(n, int):
            return True
        expr: Any = getattr(getattr(n, "node", None), "expr", n)  # a sympy expression
        return not expr.free_symbols

    return [
        a
        for a in dynamic.axes
        if any(isinstance(vals[i], torch.Tensor) and fixed(vals[i].shape[d]) for i, d in a.dims)
    ]


def export(
    model: nn.Module, inputs: tuple, dynamic: Dynamic | None = None, *, runtime: bool = False
) -> Exported:
    """(program, note, kept): torch.export of `model` with the capture's dynamic axes (a
    graph.dynamic.Dynamic) kept dynamic, and the axes it kept. An axis torch.export
    specialises is exported static and named in the note; when exporting dynamic fails,
    the program takes the example's shapes only, with a note saying so. The program
    returns plain dicts and lists where the model does (see `_plain_outputs`).

    The capture's size guards (`dynamic.guards`) go into the program as its own guards
    (`_checked`), so that model.pt2 refuses the sizes where the model takes another path.
    `runtime`: the program is for a file that cannot refuse a size (.onnx, OpenVINO's IR,
    .pte, a TVM library), so the axes a branch guard reads are exported static instead
    (graph.dynamic.Dynamic.for_files), and the note says why."""
    why = None
    if dynamic is not None and runtime:
        narrowed = dynamic.for_files("the file")
        if narrowed is not dynamic:
            why, dynamic = narrowed.notes[-1], narrowed
    ep, note, kept = _export(_checked(model, dynamic, runtime), inputs, dynamic)
    if why is not None:
        note = f"{note}; {why}" if note else why
    ep = _plain_outputs(ep)
    from opswap.graph.capture import OUTPUT_NAMES, output_names_of

    if names := output_names_of(model):
        ep.graph_module.meta[OUTPUT_NAMES] = names
    return ep, note, kept


def _checked(model: nn.Module, dynamic: Dynamic | None, runtime: bool) -> nn.Module:
    """`model`, or, when it is a graph opswap holds (an fx.GraphModule: a capture or a
    rewrite of one) and the capture kept size guards, a graph module sharing its weights
    whose first node checks them (graph.guards.check_sizes), which torch.export traces
    into the program's own guards. A model of the user's holds its branches itself; a
    runtime's program has no way to check (see `export`)."""
    if runtime or dynamic is None or not dynamic.guards or not isinstance(model, fx.GraphModule):
        return model
    from opswap.graph.guards import check_sizes

    graph = fx.Graph(tracer_cls=model.graph._tracer_cls)
    graph._codegen = model.graph._codegen  # an exported graph's input and output pytrees
    graph.output(graph.graph_copy(model.graph, {}))
    places = [n for n in graph.nodes if n.op == "placeholder"]
    if not places:
        return model
    with graph.inserting_after(places[-1]):
        graph.call_function(check_sizes, (tuple(places), tuple(g.code for g in dynamic.guards)))
    checked = fx.GraphModule(model, graph, class_name=type(model).__name__)
    checked.meta.update(model.meta)
    return checked


def _plain_outputs(ep: ExportedProgram) -> ExportedProgram:
    """`ep` with FX's immutable_dict and immutable_list in its output structure made dict
    and list again. Non-strict torch.export of an fx.GraphModule (torch 2.11-2.14) records
    the output node's own containers, so a rewritten model that returns a dict would come
    back from model.pt2 as an immutable_dict: a different structure from the user's, which
    verification rightly refuses and a caller's `out["x"] = ...` would trip over."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list
    from torch.utils import _pytree as pytree

    graph = ep.module_call_graph
    if not graph or graph[0].signature is None:
        return ep
    spec = graph[0].signature.out_spec

    def plain(o: Any) -> Any:  # any value of the outputs' pytree
        if isinstance(o, immutable_dict) or type(o) is dict:
            return {k: plain(v) for k, v in o.items()}
        if isinstance(o, immutable_list) or type(o) is list:
            return [plain(v) for v in o]
        if type(o) is tuple:
            return tuple(plain(v) for v in o)
        if isinstance(o, tuple) and hasattr(o, "_fields"):  # a namedtuple
            return type(o)(*(plain(v) for v in o))
        return o

    tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    graph[0].signature.out_spec = pytree.tree_flatten(plain(tree))[1]
    return ep


def _export(model: nn.Module, inputs: tuple, dynamic: Dynamic | None = None) -> Exported:
    from opswap.graph.dynamic import Dynamic, export_shapes

    shapes = export_shapes(inputs, dynamic) if dynamic is not None else None
    if shapes is None or dynamic is None:
        return torch.export.export(model, inputs, strict=False), None, Dynamic()
    try:
        ep = _dynamic_export(model, inputs, shapes, dynamic)
    except Exception as e:
        note = (
            "model.pt2 accepts only the example's input shapes: exporting with "
            f"dynamic {', '.join(a.name for a in dynamic.axes)} failed ({_first_line(e)})"
        )
        return torch.export.export(model, inputs, strict=False), note, Dynamic()
    fixed = _specialised(ep, inputs, dynamic)
    if not fixed:
        return ep, None, _claimed(ep, inputs, dynamic)
    kept = Dynamic(
        [a for a in dynamic.axes if a not in fixed], list(dynamic.notes), list(dynamic.guards)
    )
    note = (
        f"model.pt2 keeps {', '.join(a.name for a in fixed)} static at the example's "
        f"size: torch.export specialised {'it' if len(fixed) == 1 else 'them'}"
        + (f"; it stays dynamic in {', '.join(a.name for a in kept.axes)}" if kept.axes else "")
    )
    shapes = export_shapes(inputs, kept)
    ep = _dynamic_export(model, inputs, shapes, kept)
    return ep, note, _claimed(ep, inputs, kept)


def _claimed(ep: ExportedProgram, inputs: tuple, dynamic: Dynamic) -> Dynamic:
    """`dynamic` with the program's own size guards added where they refuse a size
    verification would check (a torchvision ResNet-50 exported at 224 x 224 guards on the
    parity of `(h - 1) // 2`, and refuses 225): the file claims the sizes inside them, and
    refuses the rest in one sentence, so verification checks it there and not at a size
    it refuses by design."""
    from torch.utils import _pytree as pytree

    from opswap.graph.dynamic import Dynamic
    from opswap.graph.guards import SizeGuard, program_guards

    if not dynamic.axes or _admits(ep, inputs, dynamic):
        return dynamic
    try:
        codes = program_guards(ep, ep.module(), len(pytree.tree_leaves(list(inputs))))
    except Exception:
        return dynamic
    have = {g.code for g in dynamic.guards}
    added = [SizeGuard(c) for c in codes if c not in have]
    return Dynamic(list(dynamic.axes), list(dynamic.notes), [*dynamic.guards, *added])


def _admits(ep: ExportedProgram, inputs: tuple, dynamic: Dynamic) -> bool:
    """Whether the program's own guards take every size verification will check it at."""
    from torch.utils import _pytree as pytree

    from opswap.graph.dynamic import variants

    fn = getattr(ep.module(), "_guards_fn", None)  # torch >= 2.9; older: nothing to ask
    if fn is None:
        return True
    for _, xs in variants(inputs, dynamic):
        try:
            fn(*pytree.tree_leaves(list(xs)))
        except Exception:
            return False
    return True


def _dynamic_export(
    model: nn.Module, inputs: tuple, shapes: Shapes, dynamic: Dynamic
) -> ExportedProgram:
    """torch.export with dynamic sizes, valid at every size verification checks. The
    default tracer assumes a dynamic size is not 0 or 1 and may guard on it: a reshape in
    a batch-2 GPT-2 leaves `B * k != k` in the program, so the file refused batch 1,
    where opswap verifies it. Where the default program's guards refuse one of those
    sizes, it is traced again size-obliviously (torch >= 2.6's `backed_size_oblivious`),
    which keeps size 1 in range and guards only what the graph needs, and that program
    is kept if its guards take them all (for a ResNet it is the other way round)."""
    from torch.fx.experimental import _config

    ep = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
    if not hasattr(_config, "backed_size_oblivious") or _admits(ep, inputs, dynamic):
        return ep
    try:
        # torch's config modules gain `patch` at import (install_config_module)
        with _config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            other = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
    except Exception:  # e.g. a data-dependent branch it cannot decide
        return ep
    return other if _admits(other, inputs, dynamic) else ep


def load(path: str | Path) -> nn.Module:
    """The module of a saved program, loaded with models.checkpoint's no-pickle checks, with
    the quick input check described above in place of the per-call guard function: the one
    loader of a saved model.pt2 (the race's, and artifact.load's)."""
    from opswap.models.checkpoint import program_module, read_program

    program = read_program(str(path))
    try:  # check_guards: torch >= 2.9, where module() builds the _guards_fn this replaces
        # module() builds a GraphModule (torch.export._unlift)
        module = cast(fx.GraphModule, program_module(program, check_guards=False))
    except TypeError:
        return program_module(program)
    name = Path(path).name
    layout = _layout(program, module)
    compiled = _compiled_guards(program, module) if layout is not None else None
    from opswap.backends.eager import fast_calls

    if layout is not None and compiled is not None:
        fast_calls(module)  # opswap's Triton ops called without the dispatcher where plain
        return _lean(module, name, layout, *compiled)
    full = cast(fx.GraphModule, program_module(program))  # torch's guard function, its cost
    if layout is None:
        return full
    fast_calls(full)
    _guards_in_words(full, name)
    return _lean(full, name, layout, None, [])  # the inputs checked before its guards


def _layout(program: ExportedProgram, module: fx.GraphModule) -> _Layout | None:
    """How the program takes its inputs (see _Layout), from its example inputs; None
    where it kept none or they do not fit its placeholders."""
    from opswap.graph.guards import leaf_labels

    if not program.example_inputs:
        return None
    args, kwargs = program.example_inputs
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    params = list(sig.parameters)
    values = [bound.arguments[p] for p in params]
    leaves, spec = pytree.tree_flatten(values)
    if len(leaves) != sum(n.op == "placeholder" for n in module.graph.nodes):
        return None
    return _Layout(params, leaf_labels(tuple(values), params), spec)


def _compiled_guards(program: ExportedProgram, module: fx.GraphModule) -> Guards | None:
    """(the all-guards predicate, each guard) or None (see graph.guards)."""
    from opswap.graph import guards

    found = guards.guards_code(program, module)
    if found is None:
        return None
    code, labels = found
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in placeholders):
        return None  # a non-tensor input: torch's guards compare its value
    names = guards.leaf_names(len(labels))
    fixed = frozenset(
        f"{arg}.size()[{d}] == {s}"
        for arg, n in zip(names, placeholders, strict=True)
        for d, s in enumerate(n.meta["val"].shape)
        if isinstance(s, int)
    )
    return guards.compile_guards(code, names, fixed)  # _lean checks the fixed sizes


def _guards_in_words(module: fx.GraphModule, name: str) -> None:
    """torch's guard function of `module` raising opswap's InputError, in one sentence,
    instead of `AssertionError: Guard failed: ...` (the inputs' count, rank, dtype and
    fixed sizes are checked before it, by _lean's hook)."""
    from opswap.errors import InputError

    fn = getattr(module, "_guards_fn", None)
    if fn is None:
        return
    inner = fn.forward

    def forward(*args: object) -> object:
        if torch.compiler.is_compiling():
            return inner(*args)
        try:
            return inner(*args)
        except AssertionError as e:
            cond = str(e).removeprefix("Guard failed: ")
            raise InputError(
                f"{name}: the inputs break the condition {cond}, under which the program "
                "was exported."
            ) from None

    fn.forward = forward


@dataclass(frozen=True)
class _Layout:
    """How a saved program takes its inputs: forward's parameters, each tensor leaf as the
    user names it (`x`, `pair[0]`), and the structure of the parameters' values."""

    params: list[str]
    labels: list[str]
    spec: pytree.TreeSpec

    @property
    def nested(self) -> bool:
        return self.spec.num_leaves != len(self.params) or any(
            c.num_children for c in _children(self.spec)
        )

    def describe(self) -> str:
        """The parameters, each holding more than a tensor with what it holds:
        "pair (a tuple of 2), extra (a dict of scale)"."""
        parts = []
        for p, child in zip(self.params, _children(self.spec), strict=True):
            parts.append(f"{p} ({_form(child)})" if child.num_children else p)
        return ", ".join(parts)


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """The specs of a node's children (`children()` in newer torch, which deprecates
    `children_specs`)."""
    children = getattr(spec, "children", None)
    return list(children() if callable(children) else spec.children_specs)


def _form(spec: pytree.TreeSpec) -> str:
    """'a tuple of 2', "a dict of ids, mask": a container of the inputs, in words."""
    kind = getattr(spec.type, "__name__", str(spec.type))
    if isinstance(spec.context, list):  # a dict's keys
        return f"a {kind} of {', '.join(map(str, spec.context))}"
    return f"a {kind} of {spec.num_children}"


def _lean(
    module: fx.GraphModule,
    name: str,
    layout: _Layout,
    holds: Callable[..., bool] | None,
    each: list[tuple[str, Callable[..., bool]]],
) -> nn.Module:
    """`module` (built without torch's guard function) with one pre-hook that checks the
    inputs: count (positional, or by the recorded names) and, for tuple or dict inputs,
    their structure; then rank, dtype and the fixed sizes of each tensor
    (graph.dynamic.check_inputs, the in-memory result's check too), then `holds`, every
    guard of the program compiled into one function."""
    from opswap.errors import InputError
    from opswap.graph.dynamic import Expected, bind_by_name, check_inputs
    from opswap.graph.guards import leaf_names, refusal

    expected = []
    for label, node in zip(
        layout.labels, (n for n in module.graph.nodes if n.op == "placeholder"), strict=True
    ):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):  # torch's guard function checks its value
            expected.append(Expected(label, None))
            continue
        static = tuple((d, int(s)) for d, s in enumerate(val.shape) if isinstance(s, int))
        expected.append(Expected(label, val.dim(), val.dtype, static))
    params, nested = layout.params, layout.nested
    n = len(params)
    listed = layout.describe()
    names = leaf_names(len(layout.labels))

    def check(
        _mod: nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]] | None:
        out: tuple[tuple, dict[str, Any]] | None = None
        if kwargs:
            if len(args) > n:
                raise InputError(f"{name} takes {n} input(s) ({listed}), got {len(args)}.")
            args = bind_by_name(name, params, args, kwargs)
            out = (args, {})
        if len(args) != n:
            raise InputError(f"{name} takes {n} input(s) ({listed}), got {len(args)}.")
        leaves: tuple | list = args
        if nested:
            leaves, spec = pytree.tree_flatten(list(args))
            if spec != layout.spec:
                raise InputError(
                    f"{name} takes its inputs as {listed}, as it was exported; got "
                    f"{', '.join(_given(a) for a in args)}."
                )
        check_inputs(name, leaves, expected, "it was exported with that size fixed")
        if holds is not None and not holds(*leaves):
            raise InputError(refusal(name, tuple(leaves), names, each, layout.labels))
        return out

    # torch's pre-hook re-walks the input pytree: ~40 µs (Module.__setattr__'s stub takes
    # only tensors and modules)
    module.validate_inputs = False  # type: ignore[assignment]
    module.register_forward_pre_hook(check, with_kwargs=True)
    module.opswap_check = check  # type: ignore[assignment]  # also before its AOTI package
    return module


def _given(x: object) -> str:
    """What one input of a call is, in words: 'a tensor', 'a tuple of 3'."""
    if isinstance(x, torch.Tensor):
        return "a tensor"
    leaves, spec = pytree.tree_flatten(x)
    return _form(spec) if spec.num_children else f"a {type(x).__name__}"


def export_artifact(
    model: nn.Module,
    inputs: tuple,
    dynamic: Dynamic | None = None,
    directory: str | Path | None = None,
    name: str = "model.pt2",
    keep_program: bool = False,
) -> Artifact:
    """Export `model`, save it under `directory` (a fresh temporary one by default) and
    reload it; never raises for a model that does not export. `keep_program` keeps the
    program in `exported`, so that an ONNX export translates the very same program."""
    directory = Path(directory or tempfile.mkdtemp(prefix="opswap-"))
    path = directory / name
    # torch.export.save writes the weights before it serialises the program, and fails
    # there on outputs pytree cannot name (torch.return_types.topk): written under another
    # name and renamed when complete, a failed save leaves no file
    partial = directory / f".{Path(name).stem}.partial{Path(name).suffix}"  # torch wants .pt2
    try:
        with torch.no_grad():
            ep, note, kept = export(model, tuple(inputs), dynamic)
            # a runtime's file keeps the axes a branch guard reads static: its own program
            files = dynamic is not None and bool(dynamic.guarded_axes()) and keep_program
            for_runtimes = export(model, tuple(inputs), dynamic, runtime=True) if files else None
        with warnings.catch_warnings():  # "No complete tensor found in the group": noise
            warnings.filterwarnings("ignore", message="No complete tensor found")
            torch.export.save(ep, str(partial))
        os.replace(partial, path)
    except Exception as e:  # export can fail on any construct
        partial.unlink(missing_ok=True)
        return Artifact(None, None, error=f"torch.export failed: {_first_line(e)}")
    exported = (for_runtimes or (ep, note, kept)) if keep_program else None
    try:
        return Artifact(path, load(path), note=note, kept=kept, exported=exported)
    except Exception as e:
        return Artifact(
            path,
            None,
            note=note,
            error=f"reloading {name} failed: {_first_line(e)}",
            kept=kept,
            exported=exported,
        )
