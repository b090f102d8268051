"""ONNX export of a model or of opswap's result: the program torch.export makes (the one
model.pt2 holds, with the same dynamic axes) translated by torch.onnx's dynamo exporter.

    from opswap.backends.onnx import export_onnx
    art = export_onnx(model, inputs, captured.dynamic, "out")   # out/model.onnx

The axes the capture claims dynamic stay dynamic in the file (backends.pt2.export: an
axis torch.export specialises is kept static and the note says so), so the .onnx file
runs at other batch sizes and sequence lengths. opswap's own ops are translated by
backends.lowerings; an op the exporter has no translation for, and opswap no lowering,
fails the export with one sentence naming it, before the exporter runs. Weights above
ONNX's 2 GB protobuf limit go to a `.data` file beside the model (the exporter's own
choice by size), which `copy_to` carries along.

`fusions=True` runs onnxscript's ONNX Runtime fusions over the exported graph
(attention, LayerNorm + residual, GELU, rotary embeddings into com.microsoft contrib
ops): an operator replacement on the ONNX graph, which only ONNX Runtime can run.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.backends.pt2 import Artifact
from opswap.errors import ExportError

if TYPE_CHECKING:
    import onnx_ir as ir
    from torch.export import ExportedProgram

    from opswap.graph.dynamic import Dynamic

#: the runtime an .onnx file is written for, named as `opswap export --to` and `optimize
#: --export` name it, and the form its static int8 Linears take (lowerings.INT8_FORMS):
#: ONNX Runtime runs MatMulInteger as an int8 GEMM, OpenVINO the QuantizeLinear /
#: DequantizeLinear pairs (docs/chapters/22-runtime.md has the timings). "onnx" is a plain,
#: portable .onnx file: QDQ pairs carry the calibrated scales themselves, where ORT's
#: MatMulInteger form quantises activations on the fly and drifts from the verified model.
INT8_FOR = {"ort": "integer", "onnx": "qdq", "openvino": "qdq"}
#: the earlier spellings of `int8=`, the forms' own names, still accepted
INT8_ALIASES = {"integer": "ort", "qdq": "openvino"}


def int8_form(runtime: str) -> str:
    """The form of static int8 Linears in a file for `runtime` (INT8_FOR, or an earlier
    spelling in INT8_ALIASES); ExportError, in one sentence, for anything else."""
    found = INT8_FOR.get(INT8_ALIASES.get(runtime, runtime)) if isinstance(runtime, str) else None
    if found is None:
        raise ExportError(
            f"int8={runtime!r} names no runtime opswap writes int8 ONNX for; use "
            f"{', '.join(repr(k) for k in INT8_FOR)} (as --to and --export name them; "
            f"{' and '.join(repr(k) for k in INT8_ALIASES)} are the earlier spellings)."
        )
    return found


# namespaces whose ops the exporter translates itself
_BUILTIN = frozenset({"aten", "prims", "_operator", "math", "builtins"})


def unlowered(program: ExportedProgram) -> list[str]:
    """The ops of `program` (an ExportedProgram) that neither torch.onnx nor opswap's
    lowerings translate, as `namespace::name`."""
    from opswap.backends.lowerings import table

    known = {o.name() for o in table()}
    found = []
    for node in program.graph.nodes:
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        if t.namespace in _BUILTIN or t.name() in known:
            continue
        found.append(t.name().replace(".default", ""))
    return list(dict.fromkeys(found))


def _cause(e: BaseException) -> str:
    """The innermost cause's first line: torch.onnx wraps the reason in several layers."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter's progress lines and its "torchvision is not installed" warnings."""
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def translate(program: ExportedProgram, *, fusions: bool = False, int8: str = "openvino") -> Any:
    """torch.onnx's ONNXProgram of `program` (an ExportedProgram), static int8 Linears in
    the form for the runtime `int8` names (`int8_form`: "ort" or "onnx" MatMulInteger,
    "openvino" QuantizeLinear/DequantizeLinear), with onnxscript's ORT fusions when
    `fusions`. Its `exported_program` is the decomposed program that was translated, whose
    node names the file's values carry (backends.runtime_layers pairs them). Raises
    ExportError naming an op without a lowering, or the exporter's reason."""
    try:
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ExportError(
            "ONNX export needs onnx and onnxscript; install them with pip install 'opswap[onnx]'."
        ) from e
    from opswap.backends.lowerings import OPSET, table

    form = int8_form(int8)
    missing = unlowered(program)
    if missing:
        raise ExportError(
            f"The model calls {', '.join(missing)}, which has no ONNX lowering; "
            "leave out the rule that puts it there (--rules) or export to model.pt2."
        )
    try:
        with _quiet():
            onnx_program = torch.onnx.export(
                program,
                (),
                dynamo=True,
                custom_translation_table=table(form),
                opset_version=OPSET,
                optimize=True,
                verbose=False,
            )
            if onnx_program is None:  # only for a model with no graph, which export refuses
                raise ExportError("torch.onnx returned no ONNX program for the model.")
            if fusions:
                from onnxscript.rewriter.ort_fusions import optimize_for_ort

                onnx_program.model, _ = optimize_for_ort(onnx_program.model)
    except ExportError:
        raise
    except Exception as e:  # the exporter fails on constructs it has no translation for
        raise ExportError(f"torch.onnx could not export the model: {_cause(e)}.") from e
    return onnx_program


def to_onnx(
    program: ExportedProgram, path: str | Path, *, fusions: bool = False, int8: str = "openvino"
) -> Path:
    """Translate `program` (an ExportedProgram) to ONNX at `path` (see `translate`).
    Raises ExportError naming an op without a lowering, or the exporter's reason."""
    onnx_program = translate(program, fusions=fusions, int8=int8)
    name_outputs(onnx_program.model, output_names(program))
    path = Path(path)
    try:
        with _quiet():
            onnx_program.save(str(path))  # external data only past 2 GB, by size
    except Exception as e:
        raise ExportError(f"torch.onnx could not write {path.name}: {_cause(e)}.") from e
    return path


def output_names(program: ExportedProgram) -> list[str]:
    """A name for each output of `program` from the model's own output structure: a dict's
    or a ModelOutput's keys (`logits`), a namedtuple's fields, positions in a tuple
    (`output_0`), joined by `_` when nested; `output` for a lone tensor. The same on every
    plan, where the exporter's names (`linear_13`) follow the last node. A model that names
    its outputs itself (graph.capture.OUTPUT_NAMES: a Hugging Face model's `logits`) gives
    those names instead of positions."""
    from opswap.graph.capture import OUTPUT_NAMES

    spec = program.call_spec.out_spec
    if spec is None:
        return []

    def walk(s: pytree.TreeSpec, path: tuple) -> list[tuple]:
        if s.is_leaf():
            return [path]
        kids = s.children() if callable(getattr(s, "children", None)) else s.children_specs
        ctx = s.context
        keys = getattr(s.type, "_fields", None)  # a namedtuple's context is its type
        if isinstance(ctx, (list, tuple)) and len(ctx) == len(kids):
            keys = ctx
        keys = keys if keys is not None and len(keys) == len(kids) else range(len(kids))
        return [p for k, c in zip(keys, kids, strict=True) for p in walk(c, (*path, k))]

    paths = walk(spec, ())
    own = program.graph_module.meta.get(OUTPUT_NAMES)
    if own and len(own) == len(paths) and len(set(own)) == len(own):
        return list(own)
    names = []
    for path in paths:
        text = "_".join(str(k) for k in path)
        names.append(
            "output" if not path else f"output_{text}" if isinstance(path[0], int) else text
        )
    return names


def name_outputs(model: ir.Model, names: list[str]) -> None:
    """Give the graph outputs of `model` (an onnx_ir Model) `names`, each through an
    Identity, so that the values keep the names that pair them with the program's nodes
    (backends.runtime_layers); left as they are when the counts differ or a name is taken."""
    import onnx_ir as ir

    graph = model.graph
    outs = list(graph.outputs)
    taken = {v.name for v in graph.inputs} | {o.name for n in graph for o in n.outputs}
    if len(outs) != len(names) or len(set(names)) != len(names):
        return
    for i, (value, name) in enumerate(zip(outs, names, strict=True)):
        if value.name == name or name in taken:
            continue
        node = ir.node("Identity", [value])
        out = node.outputs[0]
        out.name, out.shape, out.type = name, value.shape, value.type
        graph.append(node)
        graph.outputs[i] = out


def export_onnx(
    model: nn.Module | None,
    inputs: tuple,
    dynamic: Dynamic | None = None,
    directory: str | Path | None = None,
    name: str = "model.onnx",
    *,
    exported: Any = None,
    fusions: bool = False,
    int8: str = "openvino",
) -> Artifact:
    """Export `model` (or translate `exported`, the (program, note, kept) backends.pt2's
    export made of it) to DIRECTORY/NAME (a fresh temporary folder by default), static int8
    Linears in the form the runtime `int8` runs fastest (`int8_form`, the names of
    `--to`: "ort" or "onnx" MatMulInteger; "openvino", the default, QuantizeLinear /
    DequantizeLinear, the interchange form other runtimes read too; "integer" and "qdq"
    are the earlier spellings); ExportError for another name. Never raises for a model
    that does not export: the Artifact's `error` says why (its `module` is left to the runtime that loads the file,
    backends.ort)."""
    from opswap.backends.pt2 import _first_line
    from opswap.backends.runtime_module import program_file

    int8_form(int8)  # a name it does not know fails before any work
    got = program_file(
        model, inputs, dynamic, exported, directory, name, reason=_first_line, needs="export_onnx"
    )
    if isinstance(got, Artifact):
        return got
    program, note, kept, path = got
    try:
        to_onnx(program, path, fusions=fusions, int8=int8)
    except ExportError as e:
        for p in (path, path.with_name(path.name + ".data")):
            p.unlink(missing_ok=True)
        return Artifact(None, None, note=note, error=str(e), kept=kept)
    return Artifact(path, None, note=note, kept=kept)


def copy_onnx(src: Path, dest: Path) -> Path:
    """Copy an .onnx file and its external data file (NAME.data, when the exporter wrote
    one) to `dest`; the data file keeps the name the model refers to."""
    src, dest = Path(src), Path(dest)
    if src.resolve() != dest.resolve():
        shutil.copyfile(src, dest)
        data = src.with_name(src.name + ".data")
        if data.is_file():
            shutil.copyfile(data, dest.with_name(src.name + ".data"))
    return dest


def holds(mine: bool, engine: str) -> str:
    """What a saved .onnx file holds, in result.json's `deploy` words, for `engine`."""
    if mine:
        return f"opswap's optimized model exported to ONNX, for {engine}"
    return (
        f"your model exported to ONNX with no rewrite, for {engine}: opswap's export did not "
        "beat it in this run"
    )
