"""The stages of one optimize run, each a function returning a typed value, and what they
share: `capture_stage` settles the `Run` (the private reference, its capture, the
target and the tolerance, resolved once); `plan_and_verify` plans, applies, verifies
and rolls back (`Checked`); `prune` times the rules and drops the slow ones (`Pruned`);
`race` races the variants (a bench.variants.Race). pipeline.optimize strings them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import fx, nn

from opswap.backends import registry
from opswap.bench.attribution import Attribution, attribute, reconcile
from opswap.bench.timing import with_timer
from opswap.bench.variants import Race, parse_compare
from opswap.bench.variants import run as run_variants
from opswap.errors import CalibrationError, CaptureError
from opswap.graph.calibrate import Calibration, attach, samples_from
from opswap.graph.calibration_data import batches
from opswap.graph.capture import Captured, capture
from opswap.graph.copies import describe_hooks, private_copy, user_hooks
from opswap.planner import Plan, apply_plan, make_plan, plan_with_graph
from opswap.rules.apply import Applied
from opswap.rules.base import EXACTNESS_ORDER, Skipped
from opswap.targets import Target, get_target
from opswap.tuning.search import Candidate, SearchError
from opswap.verify import outputs
from opswap.verify.bisect import Rollback, rollback
from opswap.verify.outputs import Verification, capture_check
from opswap.verify.samples import make_samples
from opswap.verify.tolerance import Tolerance, tolerance_for

if TYPE_CHECKING:
    from opswap.config import OptimizeConfig


def _to_device(
    model: nn.Module, example_inputs: tuple[Any, ...], device: str
) -> tuple[nn.Module, tuple[Any, ...]]:
    """The (private) model and the inputs on `device`."""
    from torch.utils import _pytree as pytree

    moved = model.to(device)
    inputs = pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, example_inputs
    )
    return moved, inputs


def run_info(
    model: nn.Module,
    captured: Captured,
    config: OptimizeConfig,
    model_settings: dict[str, Any] | None,
) -> dict[str, Any]:
    """What this run ran, for result.json and the report: enough to reproduce a figure."""
    import inspect

    from opswap.bench.timing import describe_device, resolve_device

    try:
        names = [p for p in inspect.signature(model.forward).parameters][
            : len(captured.example_inputs)
        ]
    except (TypeError, ValueError):
        names = []
    names += [f"input{i}" for i in range(len(names), len(captured.example_inputs))]
    inputs = [
        {"name": n, "shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")}
        if isinstance(x, torch.Tensor)
        else {"name": n, "shape": [], "dtype": type(x).__name__}
        for n, x in zip(names, captured.example_inputs, strict=True)
    ]
    settings = dict(model_settings or {})
    return {
        "inputs": inputs,
        "threads": torch.get_num_threads(),
        "device": describe_device(resolve_device(config.device)),
        "model_settings": settings,
        "attn_implementation": settings.get("attn_implementation"),
        "compare": config.compare,
        "seed": config.seed,
    }


def guarded(gm: nn.Module, captured: Captured, model: nn.Module) -> nn.Module:
    """The in-memory result, refusing in one sentence a call outside what was claimed."""
    import inspect

    from opswap.graph.dynamic import guard
    from opswap.graph.keywords import KeywordCall

    hint = model.describe() if isinstance(model, KeywordCall) else ""
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = None
    return guard(gm, captured.example_inputs, captured.dynamic, hint=hint, params=params)


_MAX_REPLANS = 4  # rollback + plan again rounds; each round removes at least one site


def leave_one_out(
    captured: Captured,
    plan: Plan,
    applied: Applied,
    replan: Callable[[set[str]], tuple[Plan, fx.GraphModule]],
    device: str,
    min_time_s: float = 0.5,
) -> Attribution:
    """Leave-one-out timing of every rule `applied` carried out (bench.attribution): the
    candidate without each rule is the graph planning without it made (`replan(without=
    {rule})`, planner.plan_with_graph's plan and graph: only timed, so not applied a
    second time unless its code does not write)."""
    without = {}
    for rule in dict.fromkeys(s.rule for s in applied.applied):
        trial, gm = replan({rule})
        try:
            gm.recompile()
        except Exception:  # apply_plan finds the site whose code does not write
            gm = apply_plan(captured, trial, shapes=False).gm
        mine = [d for d in plan.decisions if d.rule == rule]
        without[rule] = (gm, len(mine), sum(d.estimate.time_saved_s or 0.0 for d in mine))
    return attribute(
        applied.gm,
        captured.gm,
        without,
        captured.example_inputs,
        device,
        min_time_s=min_time_s,
        copy=bool(captured.writes_inputs),
    )


@dataclass
class Run:
    """What the capture stage settled for the stages after it: the settings, the target,
    the private reference, its capture, the tolerance, and the rules and sites taken out
    so far (by rollback and pruning; every plan made afresh leaves them out)."""

    config: OptimizeConfig
    name: str
    target: Target
    reference: nn.Module
    captured: Captured
    tolerance: Tolerance
    hooks: list[Any]
    excluded_rules: set[str] = field(default_factory=set)
    excluded_sites: dict[tuple[str, str], str] = field(default_factory=dict)
    #: what the stages say to the report (rules left out for the chosen export, ...)
    notes: list[str] = field(default_factory=list)
    #: the user's input batches verification judges on (calibration data: `calibrate_stage`
    #: holds some out), and what they are in words; None: the example and random samples
    data: list[tuple[Any, ...]] | None = None
    data_said: str = ""
    #: with config.search "joint": the choices the joint search settled on (tuning.search),
    #: which every later plan keeps
    chosen: Candidate | None = None

    def _settings(self, without: set[str] | frozenset[str]) -> dict[str, Any]:
        return dict(
            target=self.target,
            rules=self.config.rules,
            exactness=self.config.exactness,
            model_name=self.name,
            exclude_rules=self.excluded_rules | set(without),
            exclude_sites=self.excluded_sites | _left_out(self.chosen),
            force_sites=self.chosen.forced if self.chosen is not None else frozenset(),
        )

    def plan_as(self, cand: Candidate) -> Plan:
        """A plan made afresh with the joint search's `cand` in place of `chosen`."""
        settings = self._settings(frozenset())
        settings["exclude_sites"] = self.excluded_sites | _left_out(cand)
        settings["force_sites"] = cand.forced
        return make_plan(self.captured, **settings)

    def replan(self, without: set[str] | frozenset[str] = frozenset()) -> Plan:
        """A plan made afresh, without the excluded rules and sites and `without`'s rules."""
        return make_plan(self.captured, **self._settings(without))

    def replan_with_graph(
        self, without: set[str] | frozenset[str] = frozenset()
    ) -> tuple[Plan, fx.GraphModule]:
        """replan(without) and the graph planning made (planner.plan_with_graph)."""
        return plan_with_graph(self.captured, **self._settings(without))

    def check(
        self, fn: Callable[..., Any], variants: Any = None, dynamic: Any = None
    ) -> Verification:
        """`fn` against the model itself, not only its capture, at every shape the capture
        claims (or at `variants`' shapes, with `dynamic` the sizes `fn` claims: None for
        the example's only). Where the run has the user's data (`data`), on that data and
        on random inputs held inside its range, at the same shapes (`check_random` is the
        check on random samples like the example)."""
        if self.data is not None:
            return self._check_on_data(fn, variants, dynamic)
        return self.check_random(fn, variants, dynamic)

    def check_random(
        self, fn: Callable[..., Any], variants: Any = None, dynamic: Any = None
    ) -> Verification:
        """`check` on the example and random samples like it, whatever data the run has."""
        # looked up when called, so that a test can stand in for the verifier
        return outputs.verify(
            self.reference,
            fn,
            self.captured.example_inputs,
            samples=self.config.samples,
            tolerance=self.tolerance,
            seed=self.config.seed,
            variants=self.captured.variants() if variants is None else variants,
            graph=self.captured.gm,
            dynamic=self.captured.dynamic if variants is None else dynamic,
        )

    def _check_on_data(self, fn: Callable[..., Any], variants: Any, dynamic: Any) -> Verification:
        return verify_on_data(
            self.reference,
            fn,
            cast(list, self.data),
            self.captured,
            samples=self.config.samples,
            tolerance=self.tolerance,
            seed=self.config.seed,
            variants=variants,
            dynamic=dynamic,
        )


def verify_on_data(
    reference: nn.Module,
    fn: Callable[..., Any],
    data: list[tuple[Any, ...]],
    captured: Captured,
    *,
    samples: int,
    tolerance: Tolerance,
    seed: int = 0,
    variants: Any = None,
    dynamic: Any = None,
) -> Verification:
    """`fn` against `reference` on the user's batches `data` (and random inputs held inside
    their range), at the other sizes the capture claims cut from the first batch when it
    has the example's shapes (or at `variants`' shapes, with `dynamic` the sizes `fn`
    claims; empty `variants`: the first batch's shapes only)."""
    from opswap.graph.dynamic import variants as at_sizes

    sizes = captured.dynamic if variants is None else dynamic
    first, example = data[0], captured.example_inputs
    if variants is not None and not variants:
        shaped: Any = ()  # the example's shapes only (a compiled variant)
    elif sizes is not None and _same_shapes(first, example):
        shaped = at_sizes(first, sizes)  # the other sizes, cut from the user's batch
    else:
        shaped = captured.variants() if variants is None else variants
    return outputs.verify(
        reference,
        fn,
        first,
        samples=samples,
        tolerance=tolerance,
        seed=seed,
        variants=shaped,
        graph=captured.gm,
        dynamic=sizes,
        given=data,
    )


def _same_shapes(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two input tuples hold tensors of the same shapes, position by position."""
    return len(a) == len(b) and all(
        not isinstance(x, torch.Tensor) or (isinstance(y, torch.Tensor) and x.shape == y.shape)
        for x, y in zip(a, b, strict=True)
    )


#: with at least this many batches of calibration data, a quarter of them is held out of
#: calibration and verification judges on those; with fewer, on the batches calibration
#: ran on (a quarter of 7 or fewer would leave calibration or verification one batch)
HOLD_OUT_FROM = 8


def held_out(samples: list[tuple[Any, ...]], where: str) -> tuple[list, list, str]:
    """The batches calibration runs on, those verification judges on, and which they are
    in words: the last quarter held out from HOLD_OUT_FROM batches up, else the same."""
    n = len(samples)
    if n >= HOLD_OUT_FROM:
        k = n // 4
        return (
            samples[:-k],
            samples[-k:],
            f"{k} batches from {where} held out of calibration (it ran on the other {n - k})",
        )
    return (
        samples,
        samples,
        f"the {n} batch{'es' if n != 1 else ''} from {where} calibration ran on (fewer than "
        f"{HOLD_OUT_FROM}, so none was held out)",
    )


@dataclass
class Checked:
    """A plan, what applying it gave, its verification, and what was rolled back."""

    plan: Plan
    applied: Applied
    verification: Verification
    rolled_back: list[Rollback] = field(default_factory=list)


@dataclass
class Pruned(Checked):
    """The checked plan after leave-one-out timing: the rules the model ran faster
    without are dropped (when the plan without them still passes)."""

    attribution: Attribution | None = None
    pruned_rules: set[str] = field(default_factory=set)


def capture_stage(
    model: nn.Module,
    example_inputs: Any,
    config: OptimizeConfig,
    name: str,
    step: Callable[[str], None],
) -> Run:
    """The private reference (on `config.device`) and its capture, with the target and the
    tolerance resolved once for every later stage."""
    target = with_timer(get_target(config.target), config.tuning_db, config.tuning_top_k)
    hooks = user_hooks(model)
    if hooks and config.keep_hooks:
        # FX tracing and torch.export leave module hooks out of the graph (the module call
        # they hang on becomes a node or is inlined), so no result of opswap runs them
        raise CaptureError(
            f"keep_hooks=True asks to keep {describe_hooks(hooks)}, but the graph opswap "
            "optimizes and saves does not run module hooks; remove them (or move what they "
            "do into forward), or leave keep_hooks off to optimize the model without them."
        )
    model = private_copy(model)  # the reference opswap runs: weight-computing hooks kept
    if config.device != "cpu":
        # time and verify where the user deploys; the user's module stays where it is
        model, example_inputs = _to_device(model, example_inputs, config.device)
    step("capture")
    captured = capture(model, example_inputs, dynamic=config.dynamic, check=capture_check)
    tol = tolerance_for(config.exactness, config.budget, captured.rounding)
    run = Run(config, name, target, model, captured, tol, hooks)
    saving = registry.for_export(config.export) if config.export is not None else None
    left = saving.left_out if saving is not None and config.device == "cpu" else None
    if left is not None:  # the saved file runs in that runtime: rules it runs slower, or not
        rules, why = left
        run.excluded_rules |= set(rules)
        run.notes.append(f"{', '.join(rules)} left out: --export {config.export} saves {why}.")
    return run


def calibrate_stage(
    run: Run,
    data: Any = None,
    *,
    where: str = "calibration_data",
    task_batches: Sequence[Any] | None = None,
) -> None:
    """Give the capture its calibration samples when the plan may quantise activations
    statically (exactness above exact): every batch of the user's `data` (named `where`
    in messages; graph.calibration_data's forms) or of the file `config.calibration`,
    else at most `config.calibration_samples` of a task's training batches, else as many
    random samples like the example (the example first). The graph is only run when a
    rule asks for a range (graph.calibrate.observed)."""
    config = run.config
    if data is not None and config.calibration is not None:
        raise CalibrationError(
            f"Calibration data came both from {where} and from the file "
            f"{config.calibration}; give one of them."
        )
    if data is None and config.calibration is not None:
        data, where = config.calibration, Path(config.calibration).name
    if EXACTNESS_ORDER[config.exactness] == 0:
        if data is not None:
            run.notes.append(
                f"Calibration data from {where} was not used: exactness exact plans no "
                "static int8 (exactness approx does)."
            )
        return
    example = run.captured.example_inputs
    if data is not None:
        samples, run.data, run.data_said = held_out(batches(data, example, where), where)
        source = f"batches from {where}"
    elif task_batches:
        samples = samples_from(task_batches, config.calibration_samples)
        source = "training batches of the task"
    else:
        samples = make_samples(example, config.calibration_samples, config.seed)
        source = "random samples like the example"
    attach(
        run.captured.gm,
        Calibration(
            samples,
            method=config.calibrate,
            symmetric=config.symmetric_activations,
            per_channel=config.per_channel_weights,
            source=source,
        ),
    )


def plan_and_verify(run: Run, step: Callable[[str], None]) -> Checked:
    """Plan, apply and verify; while verification fails, bisect to the sites that break it,
    take them out and plan again, so that sites depending on a rolled-back one are
    matched afresh."""
    step("plan")
    plan = run.replan()
    if run.config.search == "joint" and (plan.decisions or plan.skipped):
        step("search")
        plan = joint_plan(run, plan)
    step("apply")
    applied = apply_plan(run.captured, plan)
    step("verify")
    out = Checked(plan, applied, run.check(applied.gm))
    for _ in range(_MAX_REPLANS):
        if out.verification.passed or not run.config.rollback or not out.plan.decisions:
            break
        step("rollback")
        _, removed = rollback(
            run.captured,
            out.plan,
            run.reference,
            run.tolerance,
            samples=run.config.samples,
            seed=run.config.seed,
            verifier=run.check if run.data is not None else None,
        )
        if not removed:
            break
        for r in removed:
            run.excluded_sites[(r.decision.rule, r.decision.site.key)] = f"rolled back: {r.reason}"
        plan = run.replan()
        applied = apply_plan(run.captured, plan)
        out = Checked(plan, applied, run.check(applied.gm), out.rolled_back + removed)
    return out


def _left_out(cand: Candidate | None) -> dict[tuple[str, str], str]:
    if cand is None:
        return {}
    return {c: "left out by the joint search (a faster plan without it)" for c in cand.excluded}


#: (the plan's graph, the plan) -> seconds per call: what the joint search times with
PlanTimer = Callable[[fx.GraphModule, Plan], float]


def joint_plan(run: Run, greedy: Plan, timer: PlanTimer | None = None) -> Plan:
    """The joint search's plan in place of greedy's `greedy` (tuning.search): each
    candidate applied to a copy of the capture, verified against the model (within the
    run's budget or not) and timed whole: here, interleaved with greedy's model, or with
    `config.ray` as a job on a Ray worker of the device's kind (tuning.scale); `timer`
    replaces the timing, for tests. The search's points go in `plan.search`; each plan
    timed goes into the tuning database, keyed by its decisions, written here."""
    from opswap.tuning.scale import Job, executor
    from opswap.tuning.search import Measurement, decision_set, joint_search, record_plan_time

    inputs = run.captured.example_inputs
    ref: dict[str, Any] = {}
    device = run.config.device
    pool = executor(run.config.ray, device) if run.config.ray and timer is None else None

    def measure(plan: Plan) -> Measurement:
        applied = apply_plan(run.captured, plan)
        verification = run.check(applied.gm)
        if timer is not None:
            secs, noise = timer(applied.gm, plan), 0.0
        elif pool is not None:  # the worker captures the model and applies the plan itself
            args = (run.reference, inputs, run.captured.method, run.config.dynamic, plan.to_json())
            got = pool.map([Job(str(decision_set(plan)), time_plan_job, args)])[0]
            if got.seconds is None:
                raise SearchError(f"A timing job failed on {got.where}: {got.error}.")
            secs, noise = got.seconds, got.noise or 0.0
        else:
            secs, noise = _time_beside(applied.gm, ref, inputs, device)
        db = getattr(run.target.timer, "db", None)
        if timer is None and db is not None:
            record_plan_time(db, run.captured.gm, plan, inputs, device, secs, noise)
        return Measurement(secs, verification.rel_l2, verification.passed, noise)

    def plan_for(cand: Candidate) -> Plan:
        return greedy if cand == Candidate() else run.plan_as(cand)

    def confirm(chosen: Plan, first: Plan) -> float:
        """chosen's time over greedy's, side by side for longer than a search step: the
        upper end of the ratio's 95% interval (its median where there is none), so that a
        plan replaces greedy's only when the whole interval says it is faster; a median
        alone let a slower bert plan through once on a loaded machine."""
        if timer is not None:
            return timer(apply_plan(run.captured, chosen).gm, chosen) / timer(
                apply_plan(run.captured, first).gm, first
            )
        from opswap.bench.timing import benchmark

        gms = {"c": apply_plan(run.captured, chosen).gm, "g": apply_plan(run.captured, first).gm}
        fns = {k: _caller(gm, inputs) for k, gm in gms.items()}
        res = benchmark(fns, warmup=3, repeats=15, min_time_s=0.5, max_time_s=2.0, device=device)
        r = res.ratio("c", "g")
        return r.of_medians if math.isnan(r.ci_high) else max(r.of_medians, r.ci_high)

    try:
        found = joint_search(
            plan_for,
            measure,
            evaluations=run.config.search_budget,
            seed=run.config.seed,
            confirm=confirm,
        )
    finally:
        if pool is not None:
            pool.close()
    run.chosen = found.chosen.candidate
    plan = cast(Plan, found.chosen.plan)
    plan.search = {**found.to_json(), "timed_on": pool.name if pool is not None else "here"}
    run.notes += found.notes
    return plan


def time_plan_job(
    model: nn.Module, inputs: tuple[Any, ...], method: str, dynamic: str, plan: dict[str, Any]
) -> tuple[float, float]:
    """A timing job of the joint search (tuning.scale), run on a worker: `model`
    captured as the driver captured it, `plan` (plan.json's form) applied, the result
    timed. The driver sends the model, not its capture, since a captured GraphModule
    does not always pickle."""
    from opswap.planner import calibrate_replay
    from opswap.tuning.scale import time_module

    captured = capture(model, inputs, cast(Any, method), dynamic=dynamic)
    p = Plan.from_json(plan)
    calibrate_replay(captured, p)
    return time_module(apply_plan(captured, p).gm, inputs)


def _caller(m: fx.GraphModule, inputs: tuple[Any, ...]) -> Callable[[], Any]:
    def run_it() -> Any:
        with torch.no_grad():
            return m(*inputs)

    return run_it


def _time_beside(
    gm: fx.GraphModule, ref: dict[str, Any], inputs: tuple[Any, ...], device: str
) -> tuple[float, float]:
    """`gm`'s median seconds per call, timed interleaved with the first model timed (held
    in `ref`) and scaled to that model's first time, so that drift between two
    candidates' timings does not read as a difference; and the relative spread."""
    from opswap.bench.timing import benchmark

    if not ref:
        res = benchmark(
            {"m": _caller(gm, inputs)},
            warmup=2,
            repeats=7,
            min_time_s=0.1,
            max_time_s=1.0,
            device=device,
        )
        ref.update(gm=gm, secs=res["m"].median)
        return res["m"].median, res["m"].iqr / max(res["m"].median, 1e-30)
    res = benchmark(
        {"ref": _caller(ref["gm"], inputs), "m": _caller(gm, inputs)},
        warmup=2,
        repeats=7,
        min_time_s=0.1,
        max_time_s=1.0,
        device=device,
    )
    ratio = res["m"].median / max(res["ref"].median, 1e-30)
    return ref["secs"] * ratio, res["m"].iqr / max(res["m"].median, 1e-30)


def prune(run: Run, checked: Checked, step: Callable[[str], None]) -> Pruned:
    """Time the result without each rule (when timing is on and it passed), and drop the
    rules it measures faster without, if the plan without them passes too."""
    out = Pruned(checked.plan, checked.applied, checked.verification, checked.rolled_back)
    config = run.config
    if not (
        config.bench
        and config.measure_rules
        and checked.applied.applied
        and checked.verification.passed
    ):
        return out
    step("measure")
    out.attribution = leave_one_out(
        run.captured, checked.plan, checked.applied, run.replan_with_graph, config.device
    )
    slow = [t for t in out.attribution.rules if t.slower]
    if not (config.prune_slow and slow):
        return out
    step("prune")
    plan = run.replan({t.rule for t in slow})
    applied = apply_plan(run.captured, plan)
    verification = run.check(applied.gm)
    if not verification.passed:
        return out
    run.excluded_rules.update(t.rule for t in slow)
    for t in slow:
        plan.skipped.append(
            Skipped(
                t.rule,
                f"all {t.sites} site{'s' if t.sites != 1 else ''}",
                f"measured slower on {t.device}: {t.with_ms:.3f} ms with it, "
                f"{t.without_ms:.3f} ms without (interval of the ratio "
                f"{t.ci_low:.2f}-{t.ci_high:.2f})",
            )
        )
    out.plan, out.applied, out.verification = plan, applied, verification
    out.pruned_rules = {t.rule for t in slow}
    out.attribution.note = (
        "measured before pruning "
        + ", ".join(t.rule for t in slow)
        + ", which the model ran faster without"
    )
    return out


def race(run: Run, pruned: Pruned, step: Callable[[str], None]) -> Race | None:
    """Race opswap's result against the input and `config.compare`'s baselines, each
    verified at the sizes it claims; the winner is what the run saves. None with timing off."""
    if not run.config.bench:
        return None
    from opswap.graph.dynamic import variants as at_sizes

    step("race")

    def check_variant(fn: Callable[..., Any], shapes: Any) -> Verification:
        # shapes: the Dynamic whose sizes the variant claims (a file's own), or False
        if not shapes:
            return run.check(fn, ())
        return run.check(fn, at_sizes(run.captured.example_inputs, shapes), shapes)

    raced = run_variants(
        run.reference,
        run.captured,
        pruned.applied.gm,
        check_variant,
        compare=parse_compare(run.config.compare),
        device=run.config.device,
        export=run.config.export,
    )
    if pruned.attribution is not None:
        # one scale for the report: the total is the race's, shared among the rules kept
        reconcile(pruned.attribution, raced.result, pruned.pruned_rules)
    return raced
