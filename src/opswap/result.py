"""`Result`: everything one optimize run found, decided, checked and measured.

Its fields are opswap.record's `RunRecord`. What a run writes to disk and how it is loaded
back is opswap.artifact's; the methods here that speak of files (`save`, `deploy`,
`to_json`, `saved_module`) hand over to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from opswap import artifact
from opswap.record import RunRecord

if TYPE_CHECKING:
    from opswap.backends.pt2 import Artifact


class Result(RunRecord):
    """Everything one optimize run found, decided, checked and measured (the fields of
    opswap.record.RunRecord), and the methods that write it and read its saved model."""

    def to_json(self) -> dict[str, Any]:
        """What result.json holds (artifact.describe)."""
        return artifact.describe(self)

    def deploy(self) -> dict[str, Any]:
        """What model.pt2 holds and how to run it (artifact.deploy)."""
        return artifact.deploy(self)

    def save(self, out_dir: str | Path, *, aot: bool | None = None) -> dict[str, Path]:
        """Write plan.json, result.json, report.md, report.html and the optimized model.
        `out_dir` then holds exactly this run: it is written beside it and swapped in, and
        the files an earlier run wrote there are removed (artifact.save). When a compiled
        variant won, also its AOTInductor package model_aoti.pt2 (`aot=False`, or
        OPSWAP_AOT=0 in the environment, skips it)."""
        return artifact.save(self, out_dir, aot=aot)

    @property
    def saved_artifact(self) -> Artifact | None:
        """The file written as model.pt2, the one the race timed (artifact.saved_artifact)."""
        return artifact.saved_artifact(self)

    @property
    def saved_module(self) -> nn.Module:
        """The module saved as model.pt2 (artifact.saved_module)."""
        return artifact.saved_module(self)

    def __repr__(self) -> str:
        """One line (print(result) once dumped ~55 KB of modules): the model, what was
        applied, the verdict with its max_abs and cosine, and the saved variant's speed-up."""
        n = len(self.plan.decisions)
        applied = f"applied {len(self.applied)} of {n} decision{'s' if n != 1 else ''}"
        if self.rolled_back:
            applied += f", {len(self.rolled_back)} rolled back"
        v = self.verification
        verdict = (
            f"verification {'PASSED' if v.passed else 'FAILED'} "
            f"(max_abs {v.max_abs:.3g}, cosine {v.cosine:.6f})"
        )
        best = next((t for t in self.variants if t.name == self.best), None)
        if best is None or best.speedup_vs_input is None:
            timed = "not timed"
        elif self.race_winner is not None:  # --save candidate kept opswap's over the winner
            timed = (
                f"saved {self.best} by request, {best.speedup_vs_input:.2f}x the input "
                f"(the race's winner: {self.race_winner})"
            )
        else:
            timed = f"best {self.best} {best.speedup_vs_input:.2f}x the input"
        return (
            f"Result(model={self.model!r}, target={self.target!r}, {applied}, {verdict}, {timed})"
        )
