"""Saving the optimized model in a form that loads without unpickling code.

First choice: torch.export's `.pt2` (graph + weights, loaded with
`torch.export.load`, no Python code executed). When the candidate does not
export, the weights go to `model_state.pt` (a plain state_dict, loadable with
`torch.load(..., weights_only=True)`) and plan.json re-creates the structure:
`opswap apply SPEC plan.json`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from opswap.errors import OpswapError


def _export(model: nn.Module, inputs: tuple, dynamic):
    """torch.export of the model with the capture's dynamic axes kept dynamic, and a note
    when it could only be exported at the example's shapes."""
    from opswap.graph.dynamic import export_shapes

    shapes = export_shapes(inputs, dynamic) if dynamic is not None else None
    if shapes is not None:
        try:
            return torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False), None
        except Exception as e:
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            note = ("model.pt2 accepts only the example's input shapes: exporting with "
                    f"dynamic {', '.join(a.name for a in dynamic.axes)} failed ({why})")
            return torch.export.export(model, inputs, strict=False), note
    return torch.export.export(model, inputs, strict=False), None


def save_model(model: nn.Module, example_inputs: tuple, plan, out: Path,
               dynamic=None) -> dict[str, Path]:
    """Write the model as DIR/model.pt2 (dynamic along `dynamic`'s axes, a
    graph.dynamic.Dynamic), or its weights when it does not export."""
    out = Path(out)
    try:
        ep, note = _export(model, tuple(example_inputs), dynamic)
        path = out / "model.pt2"
        torch.export.save(ep, str(path))
        note_path = out / "model_shapes.txt"
        if note:
            note_path.write_text(note + "\n")
        elif note_path.exists():
            note_path.unlink()
        return {"model": path}
    except Exception as e:  # export can fail on any construct; the state_dict always works
        path = out / "model_state.pt"
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(state, str(path))
        (out / "model_state.txt").write_text(
            "model.pt2 could not be written because torch.export failed on the optimized "
            f"model: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n"
            "model_state.pt holds its weights (torch.load(path, weights_only=True)); rebuild "
            "the module with `opswap apply SPEC plan.json`.\n"
        )
        return {"model": path}


def load_model(path: str | Path) -> nn.Module:
    """Load a model saved by `save_model` (a .pt2 file, or a directory holding one), with the
    same no-pickle checks as the `model.pt2` model spec."""
    from opswap.models.checkpoint import load_checkpoint

    path = Path(path)
    if path.is_dir():
        path = path / "model.pt2"
    if not path.is_file():
        raise OpswapError(f"No saved model at {path}; `opswap optimize ... --out DIR` writes DIR/model.pt2.")
    return load_checkpoint(str(path), str(path), {}).module
