"""`path/to/model.pt2`: a program saved by torch.export.save, loaded without running pickled code.

torch.export.load reads the graph from JSON and plain tensors from raw bytes, but
falls back to pickle for tensor subclasses, script objects, opaque objects and
sample inputs it cannot read safely. Before loading, opswap reads the archive's
weight and constant tables and refuses any entry that would be unpickled; while
loading, torch.load is held to weights_only=True. The example inputs are the
sample inputs stored in the archive.

A program whose outputs are a library's classes (transformers' ModelOutput subclasses)
reads back only where torch's pytree knows them: the loader reads their names from the
archive and registers them by importing a fixed module of that library
(`_TREE_MODULES`), never a module the file names; a class still unknown is named in the
error, and so is torch's own cause when torch.export.load fails.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from opswap.errors import SpecError
from opswap.models._common import LoadedModel, as_input_tuple

# Classes a program may return that torch's pytree must know to read the file back, by
# the library that defines them, and the fixed modules opswap imports to register them:
# never a module the file names. transformers registers every ModelOutput subclass with
# pytree as the class is defined (ModelOutput.__init_subclass__, under "module.Name"); the
# generic outputs (SequenceClassifierOutput, Seq2SeqLMOutput, ...) live in modeling_outputs.
_TREE_MODULES = {"transformers": ("transformers.modeling_outputs",)}
_MODULES_NAMED = [m for ms in _TREE_MODULES.values() for m in ms]
_TABLE_SUFFIXES = ("_weights_config.json", "_constants_config.json")
# Payload file prefixes torch.export writes as raw tensor bytes (no pickle).
_RAW_PREFIXES = ("weight_", "tensor_")


def _refuse(path: str, why: str) -> SpecError:
    return SpecError(
        f"{path} cannot be loaded safely: {why}; re-export the model with plain tensors, or "
        f"load it through a file.py:function spec you trust."
    )


def _scan(path: str) -> set[str]:
    """Refuse an archive whose weight or constant tables need pickle; the pytree type names
    of the program's inputs and outputs."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise SpecError(
            f"{path} is not a torch.export archive (not a zip file); save it with torch.export.save."
        ) from e
    with archive:
        names = archive.namelist()
        programs = [n for n in names if n.endswith("models/model.json")]
        if not programs:
            raise SpecError(f"{path} holds no exported program; save it with torch.export.save.")
        types = _tree_types(archive.read(programs[0]))
        for name in names:
            parts = name.split("/")
            if "data" in parts and name.endswith(".pt") and "sample_inputs" not in parts:
                raise _refuse(path, f"it stores {name} in the legacy pickled format")
            if not name.endswith(_TABLE_SUFFIXES):
                continue
            table = json.loads(archive.read(name)).get("config", {})
            for fqn, meta in table.items():
                if meta.get("use_pickle") or not str(meta.get("path_name", "")).startswith(
                    _RAW_PREFIXES
                ):
                    raise _refuse(path, f"'{fqn}' is a pickled object ({meta.get('path_name')})")
    return types


def _tree_types(program_json: bytes) -> set[str]:
    """The `type` names in the in_spec and out_spec trees of a serialised program."""
    try:
        calls = json.loads(program_json)["graph_module"]["module_call_graph"]
    except (ValueError, KeyError, TypeError):
        return set()  # another layout: torch.export.load says what it lacks
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for child in node.get("children_spec") or ():
                walk(child)

    for call in calls if isinstance(calls, list) else ():
        sig = (call or {}).get("signature") or {}
        for key in ("in_spec", "out_spec"):
            try:
                spec = json.loads(sig.get(key) or "null")
            except ValueError:
                continue
            if isinstance(spec, list) and len(spec) == 2:  # [protocol, tree]
                walk(spec[1])
    return found


def _register_tree_types(path: str, types: set[str]) -> None:
    """Make torch's pytree know the classes a program returns, from `_TREE_MODULES` only."""
    from torch.utils import _pytree as pytree

    known = getattr(pytree, "SERIALIZED_TYPE_TO_PYTHON_TYPE", None)  # torch 2.2 to 2.14 at least
    if known is None:
        return
    missing = sorted(t for t in types if t not in known)
    for library in sorted({t.split(".")[0] for t in missing} & set(_TREE_MODULES)):
        for module in _TREE_MODULES[library]:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise SpecError(
                    f"{path} returns {library} classes "
                    f"({', '.join(t for t in missing if t.startswith(library + '.'))}); "
                    f"install {library} to load it ({e})."
                ) from e
    unknown = [t for t in missing if t not in known]
    if unknown:
        raise SpecError(
            f"{path} returns {unknown[0]}, a class torch's pytree does not know in this process; "
            f"import the module that defines and registers it ({unknown[0].rpartition('.')[0]}) "
            f"before loading (opswap itself imports only {', '.join(_MODULES_NAMED)})."
        )


@contextlib.contextmanager
def _torch_export_errors() -> Iterator[list[str]]:
    """The exceptions torch.export.load logs instead of raising (it raises "check the
    warnings above"), as `Type: message` lines."""
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.exc_info and record.exc_info[1] is not None:
                e = record.exc_info[1]
                while e.__cause__ is not None or e.__context__ is not None:
                    e = e.__cause__ or e.__context__
                text = str(e).strip()
                seen.append(f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}")

    logger = logging.getLogger("torch.export")
    handler = Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def _weights_only() -> Iterator[None]:
    """Hold torch.load to weights_only=True, even where torch.export would fall back."""
    original = torch.load

    @functools.wraps(original)
    def safe_load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


def read_program(path: str):
    """The ExportedProgram saved at `path`, read with the checks above; it must carry the
    example inputs, positional ones only."""
    if not os.path.isfile(path):
        raise SpecError(f"Checkpoint {path} does not exist.")
    _register_tree_types(path, _scan(path))
    import warnings

    import opswap.kernels  # noqa: F401  (a program opswap saved may call torch.ops.opswap.*)

    try:
        # torch.export.load warns "No complete tensor found in the group" for every weight
        # that shares storage with none: noise for a user
        with _weights_only(), warnings.catch_warnings(), _torch_export_errors() as logged:
            warnings.filterwarnings("ignore", message="No complete tensor found")
            program = torch.export.load(path)
    except Exception as e:
        cause = logged[-1] if logged else f"{type(e).__name__}: {e}"
        raise SpecError(f"torch.export.load could not read {path}: {cause}") from e
    stored = program.example_inputs
    if not stored or not stored[0]:
        raise SpecError(
            f"{path} stores no example inputs; save it from torch.export.export(model, args) "
            f"with torch.export.save, or load the model through a file.py:function spec."
        )
    if stored[1]:
        raise SpecError(
            f"{path} was exported with keyword inputs ({', '.join(stored[1])}); "
            f"opswap passes inputs positionally."
        )
    return program


def program_module(program, *, check_guards: bool = True) -> torch.nn.Module:
    """`program.module()` in inference mode; `check_guards=False` leaves out torch's guard
    function (the caller checks the guards itself)."""
    module = program.module() if check_guards else program.module(check_guards=False)
    # An exported graph has its train/eval behaviour baked in and forbids .eval();
    # clear the flags so that callers checking `.training` see inference mode.
    for sub in module.modules():
        sub.training = False
    return module


def load_checkpoint(path: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """Load an ExportedProgram saved with torch.export.save as a GraphModule."""
    if overrides:
        raise SpecError(
            f"{spec} is a saved program with fixed shapes and takes no overrides "
            f"(got {', '.join(sorted(overrides))})."
        )
    program = read_program(path)
    inputs = as_input_tuple(tuple(program.example_inputs[0]), path)
    name = os.path.splitext(os.path.basename(path))[0]
    return LoadedModel(
        name=name,
        spec=spec,
        source="checkpoint",
        module=program_module(program),
        example_inputs=inputs,
        description=f"exported program loaded from {path}",
    )
