"""The whole flow in one place: capture -> analyze -> plan and verify -> prune -> race.

`optimize` is a driver that reads as its list of stages (opswap.stages: each a function
of the run's settings and the previous stages' values, returning a typed value). The
result is a `Result` (opswap.result) that can write plan.json, result.json, the report and
the model (opswap.artifact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from torch import fx, nn

from opswap.artifact import (
    SAVE_CHOICES,
    CandidateFailed,
    artifact_key,
    file_claim,
    keep_candidate,
)
from opswap.bench.attribution import Attribution
from opswap.bench.device import check_device
from opswap.bench.runtimes import EXPORTS, SAVES, missing
from opswap.bench.variants import Race, parse_compare
from opswap.cost.analyze import Analysis
from opswap.errors import OpswapError, RuleError, VerificationError
from opswap.graph.calibrate import calibration_of
from opswap.graph.calibration_data import check_path
from opswap.graph.capture import Captured
from opswap.graph.copies import describe_hooks
from opswap.graph.dynamic import Dynamic
from opswap.kernels.observers import METHODS as CALIBRATION_METHODS
from opswap.models.task import Accuracy, Task
from opswap.planner import CALIBRATED_RULES, Plan, plan_with_graph
from opswap.result import Result
from opswap.rules.apply import Applied
from opswap.rules.base import EXACTNESS_ORDER
from opswap.rules.registry import parse_patterns
from opswap.stages import (
    Pruned,
    Run,
    calibrate_stage,
    capture_stage,
    guarded,
    leave_one_out,
    plan_and_verify,
    prune,
    race,
    run_info,
)
from opswap.verify.tolerance import tolerance_for


@dataclass
class OptimizeConfig:
    """Settings of one `optimize` run; the CLI flags map onto these fields. A setting the
    run could not use is refused when the config is made, in one sentence."""

    target: str = "cpu"
    # glob patterns, or one comma-separated string of them (made a list); empty = every rule
    rules: list[str] | str = field(default_factory=list)
    exactness: str = "exact"  # loosest rule class allowed: exact < approx < lossy
    budget: str | None = None  # e.g. "cosine>=0.9999"; default follows exactness
    samples: int = 3  # random input samples verification runs on
    seed: int = 0
    bench: bool = True
    layers: bool = True  # layer-by-layer comparison in the report
    rollback: bool = True  # bisect and drop sites that break the budget
    measure_rules: bool = True  # time the result without each rule (measured per-rule gain)
    prune_slow: bool = True  # drop the rules the model measures faster without (beyond noise)
    device: str = "cpu"
    dynamic: str = "auto"  # input sizes kept symbolic: auto, none, batch, seq, I:D=name,...
    compare: str = "compile"  # baselines raced beside opswap's result: compile, ort, openvino, none
    # "onnx" or "ort": race ONNX Runtime and save model.onnx; "openvino": OpenVINO and its IR
    # (model.xml); "executorch" or "pte": ExecuTorch and model.pte
    export: str | None = None
    keep_hooks: bool = False  # refuse a model with hooks rather than optimize it without them
    # static int8's calibration: range method (minmax, percentile, mse, entropy), how many
    # sample inputs it runs, symmetric or asymmetric activations, per-channel weights
    calibrate: str = "minmax"
    calibration_samples: int = 8
    symmetric_activations: bool = False
    per_channel_weights: bool = True
    # a file of calibration batches (.pt, .npy, .npz: graph.calibration_data), every batch
    # used; without it, `calibration_samples` random samples or a task's training batches
    calibration: str | None = None
    # what the run saves: "winner" (the race's fastest verified variant) or "candidate"
    # (opswap's model even where it loses the race; refused where it fails verification)
    save: str = "winner"

    def __post_init__(self) -> None:
        self.rules = list(parse_patterns(self.rules))  # a comma-separated string too
        if self.exactness not in EXACTNESS_ORDER:
            raise RuleError(f"exactness must be exact, approx or lossy; got {self.exactness!r}.")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise VerificationError(
                f"samples must be at least 1 (the example itself); got {self.samples!r}."
            )
        if self.calibrate not in CALIBRATION_METHODS:
            raise RuleError(
                f"calibrate must be one of {', '.join(CALIBRATION_METHODS)}; got {self.calibrate!r}."
            )
        if (
            isinstance(self.calibration_samples, bool)
            or not isinstance(self.calibration_samples, int)
            or self.calibration_samples < 1
        ):
            raise RuleError(
                f"calibration_samples must be at least 1; got {self.calibration_samples!r}."
            )
        if self.save not in SAVE_CHOICES:
            raise OpswapError(f"save must be {' or '.join(SAVE_CHOICES)}; got {self.save!r}.")
        if self.calibration is not None:  # a missing file fails before the model loads
            self.calibration = str(check_path(self.calibration))
        tolerance_for(self.exactness, self.budget)  # a budget it cannot read fails now
        check_device(self.device)  # so do a device name and CUDA without a GPU
        if self.bench:
            parse_compare(self.compare)  # so does a typo in the baselines
        if self.export is not None and self.export not in EXPORTS:
            raise OpswapError(
                f"export must be one of {', '.join(EXPORTS)}; got {self.export!r} "
                "(model.pt2 is written either way)."
            )
        if self.export is not None and not self.bench:
            raise OpswapError(
                f"--export {self.export} saves {SAVES[self.export]}, the file the race "
                "verified and timed; drop --no-bench to export."
            )
        absent = missing(self.export) if self.export is not None else None
        if absent is not None:
            raise OpswapError(absent)


def measure_rules(
    captured: Captured,
    plan: Plan,
    applied: Applied,
    *,
    device: str = "cpu",
    min_time_s: float = 0.5,
) -> Attribution:
    """Leave-one-out timing of every rule `applied` (the result of `apply_plan(captured,
    plan)`) carried out: each candidate without one rule is planned again with the plan's
    own settings, and all are timed in one run (bench.attribution)."""
    from opswap.bench.timing import with_timer
    from opswap.targets import get_target

    target = with_timer(get_target(plan.settings.target))

    def replan(without: set[str] | frozenset[str] = frozenset()) -> tuple[Plan, fx.GraphModule]:
        return plan_with_graph(
            captured,
            target=target,
            rules=plan.settings.rules,
            exactness=plan.settings.exactness,
            exclude_rules=set(without),
        )

    return leave_one_out(captured, plan, applied, replan, device, min_time_s)


def optimize(
    model: nn.Module,
    example_inputs: Any,
    config: OptimizeConfig | None = None,
    *,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
    model_settings: dict[str, Any] | None = None,
    calibration_data: Any = None,
    calibration_from: str = "calibration_data",
    task: Task | None = None,
) -> Result:
    """Run the whole flow on `model` and return a Result.

    The user's module is never called nor changed: opswap captures, verifies against and
    times a private copy of it, without the user's hooks (with `config.keep_hooks`, a model
    that has hooks is refused instead, since the graph would not run them).
    `progress(stage: str)` is called as each stage starts, for progress bars.
    `model_settings` (the loader's settings: sizes, batch, --set overrides, attention
    implementation) are recorded in result.json and the report.
    `calibration_data` is what static int8 calibrates on, every batch of it: a list of
    input batches, one tensor of stacked samples, or a file's path (graph.
    calibration_data's forms; `calibration_from` names it in messages); without it, and
    with `exactness` above exact, it calibrates on the file `config.calibration`, else
    on a `task`'s calibration batches (models.task: from its training split), else on
    random samples like the example. With a `task`, `result.accuracy` holds its metric
    for the model and for what is saved.
    """
    from opswap.cost.analyze import analyze
    from opswap.verify.layers import compare_layers

    config = config or OptimizeConfig()
    step = progress or (lambda stage: None)
    run = capture_stage(model, example_inputs, config, name or type(model).__name__, step)
    calibrate_stage(
        run,
        calibration_data,
        where=calibration_from,
        task_batches=task.calibration if task is not None else None,  # its training split
    )
    step("analyze")
    before = analyze(run.captured, run.target)
    checked = plan_and_verify(run, step)
    pruned = prune(run, checked, step)
    if config.save == "candidate" and not pruned.verification.passed:
        raise CandidateFailed(
            "--save candidate: opswap's candidate did not pass verification ("
            + "; ".join(pruned.verification.reasons)[:300]
            + "), so nothing was saved."
        )
    # with the user's data the verdict is reached on it; random samples like the example
    # are checked too, and reported beside it
    random_check = run.check_random(pruned.applied.gm) if run.data is not None else None
    layers = None
    if config.layers:
        step("layers")
        layers = compare_layers(run.captured, pruned.applied, run.captured.example_inputs)
    after = analyze(pruned.applied.captured, run.target)
    raced = race(run, pruned, step)
    result = _result(
        run,
        pruned,
        raced,
        before,
        after,
        layers,
        run_info(run.reference, run.captured, config, model_settings),
        random_check,
    )
    if task is not None:
        step("accuracy")
        result.accuracy = accuracy(task, run.reference, result.saved_module, config.device)
        if raced is not None:
            _task_rows(task, raced, result, config.device)
    return result


def _task_rows(task: Task, raced: Race, result: Result, device: str) -> None:
    """`task`'s metric on every variant the race could run, into its row's accuracy."""
    from opswap.bench.accuracy import task_scores

    runs = {v.name: v.fn for v in raced.variants if v.fn is not None}
    scores = task_scores(task, runs, device)
    for t in result.variants:
        if t.name in scores:
            t.accuracy = {**(t.accuracy or {"passed": t.verified}), "task": scores[t.name]}


def accuracy(task: Task, reference: nn.Module, saved: nn.Module, device: str) -> Accuracy:
    """`task`'s metric for the float model and for the module the run saves (the file the
    race timed, reloaded: the same object the race verified), inputs moved to `device`."""

    def on(fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *xs: fn(*(x.to(device) for x in xs))

    return Accuracy(
        task.metric, task.evaluate(on(reference)), task.evaluate(on(saved)), task.description
    )


def _result(
    run: Run,
    pruned: Pruned,
    raced: Race | None,
    before: Analysis,
    after: Analysis,
    layers: Any,
    info: dict[str, Any],
    random_check: Any = None,
) -> Result:
    """The stages' values gathered into one Result; `raced` is the race, None untimed."""
    dynamic: Dynamic | None = run.captured.dynamic
    notes: list[str] = list(run.notes)
    winner, verified_as = (raced.winner, raced.verified_as) if raced else (None, None)
    if raced is not None and run.config.save == "candidate":
        winner, verified_as = keep_candidate(raced, run.config.export)
    if raced is not None:
        saved = raced.artifacts.get(artifact_key(cast(Any, winner).name))
        dynamic = file_claim(dynamic, saved, notes)
        notes += raced.notes
    hooks = run.hooks
    cal = calibration_of(run.captured.gm)
    if cal is not None and any(s.rule in CALIBRATED_RULES for s in pruned.applied.applied):
        notes.append(f"Static int8 calibrated on {cal.describe()}.")
    return Result(
        model=run.name,
        target=run.target.name,
        config=run.config,
        reference=run.reference,
        candidate=guarded(pruned.applied.gm, run.captured, run.reference),
        example_inputs=run.captured.example_inputs,
        plan=pruned.plan,
        applied=pruned.applied.applied,
        failed=pruned.plan.failed + pruned.applied.failed,
        rolled_back=pruned.rolled_back,
        verification=pruned.verification,
        analysis_before=before,
        analysis_after=after,
        layers=layers,
        benchmark=raced.benchmark if raced else None,
        rule_timings=pruned.attribution.rules if pruned.attribution is not None else [],
        attribution=pruned.attribution,
        notes=(
            [
                f"The model has {describe_hooks(hooks)}; opswap verified, optimized and "
                "timed a copy without them (keep_hooks=True refuses the model instead)."
            ]
            if hooks
            else []
        )
        + list(run.captured.notes)
        + list(pruned.plan.notes)
        + notes,
        dynamic=dynamic,
        variants=raced.timings if raced else [],
        best=winner.name if winner is not None else "opswap",
        captured_gm=run.captured.gm,
        artifacts=raced.artifacts if raced else {},
        verified_as=verified_as,
        race_winner=(
            raced.winner.name
            if raced and winner is not None and winner is not raced.winner
            else None
        ),
        settled=raced.settled if raced else None,
        run_info=info,
        verified_on=run.data_said or None,
        random_check=random_check,
        check_data=run.data,
    )
