"""`RunRecord`: the fields of one optimize run's `Result`, with nothing that speaks of files.

opswap.artifact writes a run to disk and reads these fields; opswap.result's `Result` adds
the methods that hand over to artifact (`save`, `deploy`, ...). The fields sit here, under
both, so that artifact names the type of what it writes without importing the module that
imports it.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import fx, nn

if TYPE_CHECKING:
    from opswap.backends.pt2 import Artifact
    from opswap.bench.attribution import Attribution, RuleTiming
    from opswap.bench.stats import ModelBench
    from opswap.bench.variants import VariantTiming
    from opswap.config import OptimizeConfig
    from opswap.cost.analyze import Analysis
    from opswap.graph.dynamic import Dynamic
    from opswap.models.task import Accuracy
    from opswap.planner import Plan
    from opswap.rules.base import Failure, Site
    from opswap.verify.bisect import Rollback
    from opswap.verify.layers import LayerReport
    from opswap.verify.outputs import Verification


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass
class RunRecord:
    """Everything one optimize run found, decided, checked and measured: the fields of a
    `Result`, which adds what speaks of files (opswap.result)."""

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
    # where a sparsity rule ran on a model with a task: its metric against sparsity
    # (train.finetune_sparse.task_curve's JSON), plotted in the report
    sparsity: dict[str, Any] | None = None
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
