"""Saving the optimized model in a form that loads without unpickling code.

First choice: torch.export's `.pt2` (graph + weights, loaded with
`torch.export.load`, no Python code executed). When the candidate does not
export, the weights go to `model_state.pt` (a plain state_dict, loadable with
`torch.load(..., weights_only=True)`) and plan.json re-creates the structure:
`opswap apply SPEC plan.json`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from opswap.errors import OpswapError


def save_model(model: nn.Module, example_inputs: tuple, plan, out: Path,
               dynamic=None, artifact=None) -> dict[str, Path]:
    """Write the model as DIR/model.pt2 (dynamic along `dynamic`'s axes, a
    graph.dynamic.Dynamic), or its weights when it does not export. With `artifact`
    (a backends.pt2.Artifact of this model, the file the race timed), that very file
    is copied instead of exporting again."""
    from opswap.backends.pt2 import export_artifact

    out = Path(out)
    path = out / "model.pt2"
    if artifact is None or artifact.path is None:
        artifact = export_artifact(model, tuple(example_inputs), dynamic, out)
    note_path = out / "model_shapes.txt"
    if artifact.path is not None:
        _partial_then_replace(path, artifact.copy_to)
        if artifact.note:
            note_path.write_text(artifact.note + "\n")
        elif note_path.exists():
            note_path.unlink()
        _remove(out, "model_state.pt", "model_state.txt")  # an earlier save's fallback
        return {"model": path}
    # export can fail on any construct; the state_dict always works
    path = out / "model_state.pt"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _partial_then_replace(path, lambda p: torch.save(state, str(p)))
    _remove(out, "model.pt2", "model_shapes.txt")  # an earlier save's model, not this one
    (out / "model_state.txt").write_text(
        "model.pt2 could not be written because torch.export failed on the optimized "
        f"model: {artifact.error}\n"
        "model_state.pt holds its weights (torch.load(path, weights_only=True)); rebuild "
        "the module with `opswap apply SPEC plan.json`.\n"
    )
    return {"model": path}


def _partial_then_replace(path: Path, write) -> None:
    """`write(p)` into a file beside `path`, renamed to `path` once complete."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _remove(out: Path, *names: str) -> None:
    for name in names:
        (out / name).unlink(missing_ok=True)


def load_model(path: str | Path) -> nn.Module:
    """Load a model saved by `save_model` (a .pt2 file, or a directory holding one), with the
    same no-pickle checks as the `model.pt2` model spec, exactly as torch.export loads it
    (guards kept; `opswap.load_optimized` gives the trimmed form that was timed)."""
    from opswap.backends.pt2 import load

    path = Path(path)
    if path.is_dir():
        path = path / "model.pt2"
    if not path.is_file():
        raise OpswapError(f"No saved model at {path}; `opswap optimize ... --out DIR` writes DIR/model.pt2.")
    return load(path, lean=False)
