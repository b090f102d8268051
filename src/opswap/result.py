"""`Result`: everything one optimize run found, decided, checked and measured.

What a run writes to disk and how it is loaded back is opswap.artifact's; the methods
here that speak of files (`save`, `deploy`, `to_json`, `saved_module`) hand over to it.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from opswap import artifact

if TYPE_CHECKING:
    from opswap.backends.pt2 import Artifact
    from opswap.bench.attribution import Attribution, RuleTiming
    from opswap.bench.stats import ModelBench
    from opswap.bench.variants import VariantTiming
    from opswap.cost.analyze import Analysis
    from opswap.graph.dynamic import Dynamic
    from opswap.models.task import Accuracy
    from opswap.pipeline import OptimizeConfig
    from opswap.planner import Plan
    from opswap.rules.base import Failure, Site
    from opswap.verify.bisect import Rollback
    from opswap.verify.layers import LayerReport
    from opswap.verify.outputs import Verification


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass
class Result:
    """Everything one optimize run found, decided, checked and measured."""

    model: str
    target: str
    config: OptimizeConfig
    reference: nn.Module  # the private copy of the user's module that opswap ran
    candidate: nn.Module  # the optimized module in memory, with its input check
    example_inputs: tuple[Any, ...]
    plan: Plan
    applied: list[Site]
    failed: list[Failure]  # the plan's and the replay's
    rolled_back: list[Rollback]
    verification: Verification
    analysis_before: Analysis | None
    analysis_after: Analysis | None
    layers: LayerReport | None = None
    benchmark: ModelBench | None = None  # the input against the candidate, from the race
    rule_timings: list[RuleTiming] = field(default_factory=list)  # attribution.rules
    attribution: Attribution | None = None  # per-rule savings and the total
    notes: list[str] = field(default_factory=list)
    dynamic: Dynamic | None = None  # the sizes the saved model keeps symbolic
    variants: list[VariantTiming] = field(default_factory=list)  # raced
    best: str = "opswap"  # the variant saved: input, captured, opswap, compile, opswap+compile
    captured_gm: fx.GraphModule | None = None  # the capture with no rewrite
    # the files of "input" and "candidate" the race timed
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    # the verification the saved file passed: {"variant", "shapes"} from the race, or None
    # when the file the winner saves passed none (then no model.pt2 is written)
    verified_as: dict[str, Any] | None = None
    # the AOTInductor package save wrote for a compiled winner, or why none (deploy.aot)
    aot: dict[str, Any] | None = None
    settled: bool | None = None  # every interval of the race narrowed in the time allowed
    # what ran: the inputs' names, shapes and dtypes, threads, device, the model's settings
    run_info: dict[str, Any] = field(default_factory=dict)
    # the task's metric for the reference and the saved model, for a model with a task
    accuracy: Accuracy | None = None
    # with save="candidate": the variant the race would have saved, where opswap's
    # candidate was kept instead (None: what is saved is the race's own choice)
    race_winner: str | None = None
    # what the verdict was reached on, in words ("2 held-out batches of cal.pt, ..."),
    # where it is not the example and random samples like it (calibration data given)
    verified_on: str | None = None
    # then: the candidate against random samples like the example, reported beside the
    # verdict and not part of it (random inputs can sit outside the calibrated ranges)
    random_check: Verification | None = None
    # the input batches verification ran on (the user's data), for the checks of the
    # files `save` writes; None: the example and random samples like it
    check_data: list[tuple[Any, ...]] | None = None
    created: str = field(default_factory=_now)

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
