"""`path/to/model.pt2`: a program saved by torch.export.save, loaded without running pickled code.

torch.export.load reads the graph from JSON and plain tensors from raw bytes, but
falls back to pickle for tensor subclasses, script objects, opaque objects and
sample inputs it cannot read safely. Before loading, opswap reads the archive's
weight and constant tables and refuses any entry that would be unpickled; while
loading, torch.load is held to weights_only=True. The example inputs are the
sample inputs stored in the archive.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from opswap.errors import SpecError
from opswap.models._common import LoadedModel, as_input_tuple

_TABLE_SUFFIXES = ("_weights_config.json", "_constants_config.json")
# Payload file prefixes torch.export writes as raw tensor bytes (no pickle).
_RAW_PREFIXES = ("weight_", "tensor_")


def _refuse(path: str, why: str) -> SpecError:
    return SpecError(
        f"{path} cannot be loaded safely: {why}; re-export the model with plain tensors, or "
        f"load it through a file.py:function spec you trust."
    )


def _scan(path: str) -> None:
    """Refuse an archive whose weight or constant tables need pickle."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise SpecError(f"{path} is not a torch.export archive (not a zip file); save it with torch.export.save.") from e
    with archive:
        names = archive.namelist()
        if not any(n.endswith("models/model.json") for n in names):
            raise SpecError(f"{path} holds no exported program; save it with torch.export.save.")
        for name in names:
            parts = name.split("/")
            if "data" in parts and name.endswith(".pt") and "sample_inputs" not in parts:
                raise _refuse(path, f"it stores {name} in the legacy pickled format")
            if not name.endswith(_TABLE_SUFFIXES):
                continue
            table = json.loads(archive.read(name)).get("config", {})
            for fqn, meta in table.items():
                if meta.get("use_pickle") or not str(meta.get("path_name", "")).startswith(_RAW_PREFIXES):
                    raise _refuse(path, f"'{fqn}' is a pickled object ({meta.get('path_name')})")


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
    _scan(path)
    import warnings

    import opswap.kernels  # noqa: F401  (a program opswap saved may call torch.ops.opswap.*)

    try:
        # torch.export.load warns "No complete tensor found in the group" for every weight
        # that shares storage with none: noise for a user
        with _weights_only(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No complete tensor found")
            program = torch.export.load(path)
    except Exception as e:
        raise SpecError(f"torch.export.load could not read {path}: {type(e).__name__}: {e}") from e
    stored = program.example_inputs
    if not stored or not stored[0]:
        raise SpecError(
            f"{path} stores no example inputs; save it from torch.export.export(model, args) "
            f"with torch.export.save, or load the model through a file.py:function spec."
        )
    if stored[1]:
        raise SpecError(f"{path} was exported with keyword inputs ({', '.join(stored[1])}); "
                        f"opswap passes inputs positionally.")
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
    return LoadedModel(name=name, spec=spec, source="checkpoint", module=program_module(program),
                       example_inputs=inputs, description=f"exported program loaded from {path}")
