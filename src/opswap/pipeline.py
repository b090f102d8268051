"""The whole flow in one place: load -> capture -> analyze -> plan -> apply -> verify -> bench.

Each stage is a plain function of the previous stage's value; `optimize` strings
them together, rolls back sites that break the accuracy budget, and returns a
`Result` (opswap.result) that can write plan.json, result.json, the report and the model
(opswap.artifact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from opswap.artifact import SAVES as _SAVES
from opswap.artifact import file_claim
from opswap.bench.attribution import Attribution, attribute, reconcile
from opswap.bench.variants import parse_compare
from opswap.bench.variants import run as run_variants
from opswap.graph.capture import Captured, capture
from opswap.graph.copies import describe_hooks, private_copy, user_hooks
from opswap.planner import Plan, apply_plan, make_plan
from opswap.result import Result
from opswap.rules.base import EXACTNESS_ORDER, Skipped


@dataclass
class OptimizeConfig:
    """Settings of one `optimize` run; the CLI flags map onto these fields."""

    target: str = "cpu"
    rules: list[str] = field(default_factory=list)  # glob patterns; empty = every rule
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
    compare: str = "compile"  # baselines raced beside opswap's result: compile, or none
    keep_hooks: bool = False  # refuse a model with hooks rather than optimize it without them


def _tolerance(config: OptimizeConfig, rounding: float | None = None):
    """The exactness's thresholds, loosened to a low-precision model's own rounding, with
    the user's budget (which is never loosened) on top."""
    from opswap.verify.tolerance import Tolerance, parse_budget

    tol = Tolerance.for_exactness(config.exactness).at_rounding(rounding)
    if config.budget:
        tol = parse_budget(config.budget, base=tol)
    return tol


def _to_device(model: nn.Module, example_inputs, device: str):
    """The (private) model and the inputs on `device`."""
    from torch.utils import _pytree as pytree

    if device.startswith("cuda") and not torch.cuda.is_available():
        from opswap.errors import OpswapError

        raise OpswapError(f"--device {device} was asked for, but torch sees no CUDA device here.")
    moved = model.to(device)
    inputs = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                             example_inputs)
    return moved, inputs


def _run_info(model, captured: Captured, config: OptimizeConfig,
              model_settings: dict[str, Any] | None) -> dict[str, Any]:
    """What this run ran, for result.json and the report: enough to reproduce a figure."""
    import inspect

    from opswap.bench.timing import describe_device, resolve_device

    try:
        names = [p for p in inspect.signature(model.forward).parameters][:len(captured.example_inputs)]
    except (TypeError, ValueError):
        names = []
    names += [f"input{i}" for i in range(len(names), len(captured.example_inputs))]
    inputs = [{"name": n, "shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")}
              if isinstance(x, torch.Tensor) else {"name": n, "shape": [], "dtype": type(x).__name__}
              for n, x in zip(names, captured.example_inputs, strict=True)]
    settings = dict(model_settings or {})
    return {"inputs": inputs, "threads": torch.get_num_threads(),
            "device": describe_device(resolve_device(config.device)),
            "model_settings": settings,
            "attn_implementation": settings.get("attn_implementation"),
            "compare": config.compare, "seed": config.seed}


def guarded(gm, captured: Captured, model) -> nn.Module:
    """The in-memory result, refusing in one sentence a call outside what was claimed."""
    from opswap.graph.dynamic import guard
    from opswap.graph.keywords import KeywordCall

    hint = model.describe() if isinstance(model, KeywordCall) else ""
    return guard(gm, captured.example_inputs, captured.dynamic, hint=hint)


_MAX_REPLANS = 4  # rollback + plan again rounds; each round removes at least one site


def measure_rules(captured: Captured, plan: Plan, applied, *, device: str = "cpu",
                  min_time_s: float = 0.5) -> Attribution:
    """Leave-one-out timing of every rule `applied` (the result of `apply_plan(captured,
    plan)`) carried out: each candidate without one rule is planned again with the plan's
    own settings, and all are timed in one run (bench.attribution)."""
    from opswap.bench.timing import with_timer
    from opswap.targets import get_target

    target = with_timer(get_target(plan.settings.target))

    def replan(without=frozenset()):
        return make_plan(captured, target=target, rules=plan.settings.rules,
                         exactness=plan.settings.exactness, exclude_rules=set(without))

    return _attribute(captured, plan, applied, replan, device, min_time_s)


def _attribute(captured: Captured, plan: Plan, applied, replan, device: str,
               min_time_s: float = 0.5) -> Attribution:
    """Leave-one-out timing of every applied rule (bench.attribution)."""
    without = {}
    for rule in dict.fromkeys(s.rule for s in applied.applied):
        trial = apply_plan(captured, replan({rule}))
        mine = [d for d in plan.decisions if d.rule == rule]
        without[rule] = (trial.gm, len(mine), sum(d.estimate.time_saved_s or 0.0 for d in mine))
    return attribute(applied.gm, captured.gm, without, captured.example_inputs, device,
                     min_time_s=min_time_s, copy=bool(captured.writes_inputs))


def optimize(
    model: nn.Module,
    example_inputs,
    config: OptimizeConfig | None = None,
    *,
    name: str | None = None,
    progress=None,
    model_settings: dict[str, Any] | None = None,
) -> Result:
    """Run the whole flow on `model` and return a Result.

    The user's module is never called nor changed: opswap captures, verifies against and
    times a private copy of it, without the user's hooks (with `config.keep_hooks`, a model
    that has hooks is refused instead, since the graph would not run them).
    `progress(stage: str)` is called as each stage starts, for progress bars.
    `model_settings` (the loader's settings: sizes, batch, --set overrides, attention
    implementation) are recorded in result.json and the report.
    """
    from opswap.bench.timing import with_timer
    from opswap.cost.analyze import analyze
    from opswap.targets import get_target
    from opswap.verify.bisect import rollback
    from opswap.verify.layers import compare_layers
    from opswap.verify.outputs import capture_check, verify

    config = config or OptimizeConfig()
    if config.exactness not in EXACTNESS_ORDER:
        from opswap.errors import RuleError

        raise RuleError(f"exactness must be exact, approx or lossy; got {config.exactness!r}.")
    if isinstance(config.samples, bool) or not isinstance(config.samples, int) \
            or config.samples < 1:
        from opswap.errors import VerificationError

        raise VerificationError(f"samples must be at least 1 (the example itself); got "
                                f"{config.samples!r}.")
    step = progress or (lambda stage: None)
    name = name or type(model).__name__
    target = with_timer(get_target(config.target))
    _tolerance(config)  # parse the budget and the baselines before any long work
    compare = parse_compare(config.compare) if config.bench else []
    hooks = user_hooks(model)
    if hooks and config.keep_hooks:
        from opswap.errors import CaptureError

        # FX tracing and torch.export leave module hooks out of the graph (the module call
        # they hang on becomes a node or is inlined), so no result of opswap runs them
        raise CaptureError(
            f"keep_hooks=True asks to keep {describe_hooks(hooks)}, but the graph opswap "
            "optimizes and saves does not run module hooks; remove them (or move what they "
            "do into forward), or leave keep_hooks off to optimize the model without them.")
    model = private_copy(model)  # the reference opswap runs: weight-computing hooks kept
    if config.device != "cpu":
        # time and verify where the user deploys; the user's module stays where it is
        model, example_inputs = _to_device(model, example_inputs, config.device)
    step("capture")
    captured: Captured = capture(model, example_inputs, dynamic=config.dynamic,
                                 check=capture_check)
    tol = _tolerance(config, captured.rounding)
    step("analyze")
    before = analyze(captured, target)
    excluded_rules: set[str] = set()
    excluded_sites: dict[tuple[str, str], str] = {}

    def replan(without: set[str] = frozenset()) -> Plan:
        return make_plan(captured, target=target, rules=config.rules,
                         exactness=config.exactness, model_name=name,
                         exclude_rules=excluded_rules | set(without),
                         exclude_sites=excluded_sites)

    step("plan")
    plan = replan()
    step("apply")
    applied = apply_plan(captured, plan)
    step("verify")

    def check(candidate) -> Any:
        # against the model itself, not only its capture, at every shape the capture claims
        return verify(model, candidate.gm, captured.example_inputs, samples=config.samples,
                      tolerance=tol, seed=config.seed, variants=captured.variants())

    verification = check(applied)
    rolled_back: list[Any] = []
    for _ in range(_MAX_REPLANS):
        if verification.passed or not config.rollback or not plan.decisions:
            break
        step("rollback")
        _, removed = rollback(captured, plan, model, tol, samples=config.samples,
                              seed=config.seed)
        if not removed:
            break
        rolled_back += removed
        for r in removed:
            excluded_sites[(r.decision.rule, r.decision.site.key)] = f"rolled back: {r.reason}"
        # plan again, so that sites depending on a rolled-back one are matched afresh
        plan = replan()
        applied = apply_plan(captured, plan)
        verification = check(applied)
    attribution: Attribution | None = None
    pruned_rules: set[str] = set()
    if config.bench and config.measure_rules and applied.applied and verification.passed:
        step("measure")
        attribution = _attribute(captured, plan, applied, replan, config.device)
        slow = [t for t in attribution.rules if t.slower]
        if config.prune_slow and slow:
            step("prune")
            excluded_rules.update(t.rule for t in slow)
            pruned = replan()
            pruned_applied = apply_plan(captured, pruned)
            pruned_check = check(pruned_applied)
            if pruned_check.passed:
                for t in slow:
                    pruned.skipped.append(Skipped(
                        t.rule, f"all {t.sites} site{'s' if t.sites != 1 else ''}",
                        f"measured slower on {t.device}: {t.with_ms:.3f} ms with it, "
                        f"{t.without_ms:.3f} ms without (interval of the ratio "
                        f"{t.ci_low:.2f}-{t.ci_high:.2f})"))
                plan, applied, verification = pruned, pruned_applied, pruned_check
                pruned_rules = {t.rule for t in slow}
                attribution.note = ("measured before pruning " + ", ".join(t.rule for t in slow)
                                    + ", which the model ran faster without")
            else:
                excluded_rules.difference_update(t.rule for t in slow)
    layers = None
    if config.layers:
        step("layers")
        layers = compare_layers(captured, applied, captured.example_inputs)
    after = analyze(applied.captured, target)
    raced: list[Any] = []
    artifacts: dict[str, Any] = {}
    winner = "opswap"
    bench = verified_as = settled = None
    dynamic, notes = captured.dynamic, []
    if config.bench:
        step("race")

        def check_variant(fn, shapes):
            # shapes: the Dynamic whose sizes the variant claims (a file's own), or False
            from opswap.graph.dynamic import variants as at_sizes

            return verify(model, fn, captured.example_inputs, samples=config.samples,
                          tolerance=tol, seed=config.seed,
                          variants=at_sizes(captured.example_inputs, shapes) if shapes else ())

        race = run_variants(model, captured, applied.gm, check_variant, compare=compare,
                            device=config.device)
        raced, winner, artifacts, bench = (race.timings, race.winner.name, race.artifacts,
                                           race.benchmark)
        verified_as, settled = race.verified_as, race.settled
        saved = artifacts.get("candidate" if _SAVES.get(winner) == "candidate" else "input")
        dynamic = file_claim(dynamic, saved, notes)
        if attribution is not None:
            # one scale for the report: the total is the race's, shared among the rules kept
            reconcile(attribution, race.result, pruned_rules)
    return Result(
        model=name,
        target=target.name,
        config=config,
        reference=model,
        candidate=guarded(applied.gm, captured, model),
        example_inputs=captured.example_inputs,
        plan=plan,
        applied=applied.applied,
        failed=plan.failed + applied.failed,
        rolled_back=rolled_back,
        verification=verification,
        analysis_before=before,
        analysis_after=after,
        layers=layers,
        benchmark=bench,
        rule_timings=attribution.rules if attribution is not None else [],
        attribution=attribution,
        notes=([f"The model has {describe_hooks(hooks)}; opswap verified, optimized and "
                "timed a copy without them (keep_hooks=True refuses the model instead)."]
               if hooks else []) + list(captured.notes) + list(plan.notes) + notes,
        dynamic=dynamic,
        variants=raced,
        best=winner,
        captured_gm=captured.gm,
        artifacts=artifacts,
        verified_as=verified_as,
        settled=settled,
        run_info=_run_info(model, captured, config, model_settings),
    )
