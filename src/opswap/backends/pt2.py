"""The saved artifact: a torch.export program written to `model.pt2`, reloaded, and timed.

What a user deploys is the file, not the module opswap holds in memory, and the two
can differ: torch.export traces through Python modules and keeps only registered
ops, so a module that picks a fused kernel in its forward would be saved as the
plain ops. So the race times the program reloaded from the file it will save
(`export_artifact`), and `Result.save` copies that very file.

Loading runs no pickled code (models.checkpoint's checks) and needs `import opswap`
first, which registers opswap's own ops (`torch.ops.opswap.*`).

Why the loaded module is trimmed: `ExportedProgram.module()` calls a `_guards_fn`
at the start of every forward, Python code that re-checks the input shapes
against sympy expressions, and a pre-hook matches the inputs' pytree against the
exported one. Measured on the 2-core CPU (torch 2.13), a one-Linear model whose
eager forward takes 9 µs: 68 µs per call as loaded, 50 µs of it the guard
function and most of the rest the pre-hook (`module(check_guards=False)` moves
similar checks into a pre-hook that cost 100 µs). `load` removes both and checks
instead, in about a microsecond, what a wrong input would break: the number of
inputs, each one's rank and dtype and every size the program was not exported
dynamic in.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class Artifact:
    """A model exported to `path` and reloaded from it (`module`), or why it could not be.
    `note` says what the file cannot do (e.g. accept other shapes)."""

    path: Path | None
    module: nn.Module | None
    note: str | None = None
    error: str | None = None

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


def export(model: nn.Module, inputs: tuple, dynamic=None):
    """torch.export of `model` with the capture's dynamic axes (a graph.dynamic.Dynamic)
    kept dynamic; falls back to the example's shapes with a note saying so."""
    from opswap.graph.dynamic import export_shapes

    shapes = export_shapes(inputs, dynamic) if dynamic is not None else None
    if shapes is not None:
        try:
            return torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False), None
        except Exception as e:
            note = ("model.pt2 accepts only the example's input shapes: exporting with "
                    f"dynamic {', '.join(a.name for a in dynamic.axes)} failed ({_first_line(e)})")
            return torch.export.export(model, inputs, strict=False), note
    return torch.export.export(model, inputs, strict=False), None


def load(path: str | Path, *, lean: bool = True) -> nn.Module:
    """The module of a saved program, loaded with models.checkpoint's no-pickle checks;
    `lean` swaps the per-call guard function for the quick input check described above."""
    from opswap.models.checkpoint import load_checkpoint

    module = load_checkpoint(str(path), str(path), {}).module
    return _lean(module, Path(path).name) if lean else module


def _lean(module: nn.Module, name: str) -> nn.Module:
    graph = getattr(module, "graph", None)
    if graph is None:
        return module
    guards = [n for n in graph.nodes if n.op == "call_module" and str(n.target) == "_guards_fn"]
    if not guards:
        return module
    expected = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return module  # a non-tensor input: keep torch's own guards
        static = tuple((d, int(s)) for d, s in enumerate(val.shape) if isinstance(s, int))
        expected.append((node.name, val.dim(), val.dtype, static))
    for n in guards:
        graph.erase_node(n)
    module.recompile()

    def check(_mod, args):
        if len(args) != len(expected):
            raise TypeError(f"{name} takes {len(expected)} input(s) ({', '.join(e[0] for e in expected)}), "
                            f"got {len(args)}.")
        for x, (arg, rank, dtype, static) in zip(args, expected, strict=True):
            if not isinstance(x, torch.Tensor) or x.dim() != rank or x.dtype != dtype:
                got = (f"{type(x).__name__}" if not isinstance(x, torch.Tensor)
                       else f"{x.dim()}-D {x.dtype}")
                raise ValueError(f"{name}: input {arg} must be a {rank}-D {dtype} tensor, got {got}.")
            for d, size in static:
                if x.shape[d] != size:
                    raise ValueError(
                        f"{name}: input {arg} must have size {size} in dim {d} (it was exported "
                        f"with that size fixed), got {tuple(x.shape)}.")

    module.validate_inputs = False  # torch's pre-hook re-walks the input pytree: ~40 µs
    module.register_forward_pre_hook(check)
    return module


def export_artifact(model: nn.Module, inputs: tuple, dynamic=None,
                    directory: str | Path | None = None, name: str = "model.pt2") -> Artifact:
    """Export `model`, save it under `directory` (a fresh temporary one by default) and
    reload it; never raises for a model that does not export."""
    directory = Path(directory or tempfile.mkdtemp(prefix="opswap-"))
    path = directory / name
    try:
        with torch.no_grad():
            ep, note = export(model, tuple(inputs), dynamic)
        with warnings.catch_warnings():  # "No complete tensor found in the group": noise
            warnings.filterwarnings("ignore", message="No complete tensor found")
            torch.export.save(ep, str(path))
    except Exception as e:  # export can fail on any construct
        return Artifact(None, None, error=f"torch.export failed: {_first_line(e)}")
    try:
        return Artifact(path, load(path), note=note)
    except Exception as e:
        return Artifact(path, None, note=note, error=f"reloading {name} failed: {_first_line(e)}")
