"""The whole flow in one place: capture -> analyze -> plan and verify -> prune -> race.

`optimize` is a driver that reads as its list of stages (opswap.stages: each a function
of the run's settings and the previous stages' values, returning a typed value). The
result is a `Result` (opswap.result) that can write plan.json, result.json, the report and
the model (opswap.artifact).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import fx, nn

from opswap.artifact import (
    CandidateFailed,
    artifact_key,
    file_claim,
    keep_candidate,
)
from opswap.bench.attribution import Attribution
from opswap.bench.variants import Race
from opswap.config import OptimizeConfig
from opswap.cost.analyze import Analysis
from opswap.graph.calibrate import calibration_of
from opswap.graph.capture import Captured
from opswap.graph.copies import describe_hooks
from opswap.graph.dynamic import Dynamic
from opswap.models.task import Accuracy, Task
from opswap.planner import CALIBRATED_RULES, Plan, plan_with_graph
from opswap.result import Result
from opswap.rules.apply import Applied
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
from opswap.tuning import TunedTimer


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
    if config.train:
        from opswap.errors import OpswapError

        raise OpswapError(
            "OptimizeConfig(train=True) is what `opswap optimize --train` runs; from Python "
            "call opswap.train.race.optimize_training, or opswap.train.prepare for your loop."
        )
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
    if isinstance(run.target.timer, TunedTimer) and run.target.timer.db is not None:
        pruned.plan.tuning = run.target.timer.summary()  # the hits and misses of the run
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
