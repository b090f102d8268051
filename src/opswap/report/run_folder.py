"""Writing a run into DIR so that DIR holds exactly that run, never a mix with an earlier one.

Everything is written into a temporary folder beside DIR (the same filesystem, so each
file moves in with an atomic rename) and moved in only once all of it is written: a
save that fails leaves DIR as it was. Before the move, the files an earlier run wrote
that this one does not (its model.pt2 when this run could only write model_state.pt)
are removed. Only the names opswap writes (`RUN_FILES`) are ever removed: a user's own
files in DIR stay. The model file moves in first and result.json last, so that a
reader never finds a result.json beside a model it does not describe.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from opswap.errors import OpswapError

# every name Result.save writes (report.optimize_report's plots included)
RUN_FILES = frozenset({
    "plan.json", "result.json", "report.md", "report.html", "model.pt2", "model_state.pt",
    "model_state.txt", "model_shapes.txt", "latency.png", "layer_errors.png",
    "categories.png", "roofline.png"})
_FIRST = ("model.pt2", "model_state.pt")
_LAST = ("result.json",)


def write_run(out_dir: str | Path, write: Callable[[Path], dict[str, Path]]) -> dict[str, Path]:
    """Call `write(folder)` on a fresh temporary folder beside `out_dir`, then swap what it
    wrote into `out_dir`; returns `write`'s paths as they lie in `out_dir`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OpswapError(f"{out} is a file; save the run into a folder (a new or an earlier "
                          f"run's one).")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        paths = write(tmp)
        written = {p.name for p in tmp.iterdir()}
        out.mkdir(exist_ok=True)
        for name in RUN_FILES - written:
            stale = out / name
            if stale.is_file() or stale.is_symlink():
                stale.unlink()
        for name in sorted(written, key=lambda n: (n not in _FIRST, n in _LAST, n)):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {k: out / Path(v).name for k, v in paths.items()}
