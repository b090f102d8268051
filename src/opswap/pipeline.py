"""The whole flow in one place: capture -> analyze -> plan and verify -> prune -> race.

`optimize` is a driver that reads as its list of stages; each stage is a function of
the run's settings and the previous stages' values and returns a typed value (a
dataclass below). The result is a `Result` that can write plan.json, result.json,
the report and the model.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opswap.bench.attribution import Attribution, attribute, reconcile
from opswap.bench.variants import Race, parse_compare
from opswap.bench.variants import run as run_variants
from opswap.errors import CaptureError, OpswapError, RuleError, VerificationError
from opswap.graph.capture import Captured, capture
from opswap.graph.copies import describe_hooks, private_copy, user_hooks
from opswap.planner import Plan, apply_plan, make_plan
from opswap.rules.apply import Applied
from opswap.rules.base import EXACTNESS_ORDER, Site
from opswap.rules.registry import parse_patterns
from opswap.targets import Target, get_target
from opswap.verify.bisect import Rollback, rollback
from opswap.verify.outputs import Verification, verify
from opswap.verify.tolerance import Tolerance, tolerance_for


@dataclass
class OptimizeConfig:
    """Settings of one `optimize` run; the CLI flags map onto these fields. A setting the
    run could not use is refused when the config is made, in one sentence."""

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

    def __post_init__(self) -> None:
        self.rules = list(parse_patterns(self.rules))  # a comma-separated string too
        if self.exactness not in EXACTNESS_ORDER:
            raise RuleError(f"exactness must be exact, approx or lossy; got {self.exactness!r}.")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) \
                or self.samples < 1:
            raise VerificationError(f"samples must be at least 1 (the example itself); got "
                                    f"{self.samples!r}.")
        tolerance_for(self.exactness, self.budget)  # a budget it cannot read fails now
        if self.bench:
            parse_compare(self.compare)  # so does a typo in the baselines


# which module a winning variant saves
_SAVES = {"input": "input", "compile": "input", "captured": "captured",
          "opswap": "candidate", "opswap+compile": "candidate"}


@dataclass
class Result:
    """Everything one optimize run found, decided, checked and measured."""

    model: str
    target: str
    config: OptimizeConfig
    reference: nn.Module
    candidate: nn.Module
    example_inputs: tuple
    plan: Plan
    applied: list[Site]
    failed: list[Any]
    rolled_back: list[Any]
    verification: Any
    analysis_before: Any
    analysis_after: Any
    layers: Any = None
    benchmark: Any = None
    rule_timings: list[Any] = field(default_factory=list)  # attribution.rules
    attribution: Any = None  # bench.attribution.Attribution: per-rule savings and the total
    notes: list[str] = field(default_factory=list)
    dynamic: Any = None  # graph.dynamic.Dynamic: the sizes the saved model keeps symbolic
    variants: list[Any] = field(default_factory=list)  # bench.variants.VariantTiming, raced
    best: str = "opswap"  # the variant saved: input, captured, opswap, compile, opswap+compile
    captured_gm: Any = None  # the capture with no rewrite
    # backends.pt2.Artifact of "input" and "candidate": the files the race timed
    artifacts: dict[str, Any] = field(default_factory=dict)
    # the verification the saved file passed: {"variant", "shapes"} from the race, or None
    # when the file the winner saves passed none (then no model.pt2 is written)
    verified_as: dict[str, Any] | None = None
    settled: bool | None = None  # every interval of the race narrowed in the time allowed
    # what ran: the inputs' names, shapes and dtypes, threads, device, the model's settings
    run_info: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))

    def to_json(self) -> dict[str, Any]:
        est = {d.site.key: d.estimate.to_json() for d in self.plan.decisions}
        return {
            "model": self.model,
            "target": self.target,
            "created": self.created,
            "versions": {"opswap": _version(), "torch": torch.__version__,
                         "python": platform.python_version()},
            "capture_method": self.plan.capture_method,
            "run": self.run_info,
            "settings": {"rules": self.config.rules, "exactness": self.config.exactness,
                         "budget": self.config.budget, "samples": self.config.samples,
                         "dynamic": self.config.dynamic},
            "dynamic": self.dynamic.to_json() if self.dynamic is not None else None,
            "applied": [
                {"rule": s.rule, "site": s.key, "description": s.description,
                 "estimate": est.get(s.key)}
                for s in self.applied
            ],
            "misses": [m.to_json() for m in self.plan.misses],
            "failed": [f.to_json() for f in self.failed],
            "rolled_back": [r.to_json() if hasattr(r, "to_json") else r for r in self.rolled_back],
            "skipped": self.plan.skipped,
            "verification": self.verification.to_json(),
            "benchmark": self.benchmark.to_json() if self.benchmark is not None else None,
            "rule_timings": [t.to_json() for t in self.rule_timings],
            "attribution": self.attribution.to_json() if self.attribution is not None else None,
            "variants": [v.to_json() for v in self.variants],
            "best": self.best,
            "timings_settled": self.settled,
            "deploy": self.deploy(),
            "analysis": {
                "before": _totals(self.analysis_before),
                "after": _totals(self.analysis_after),
            },
            "notes": self.notes,
        }

    def __repr__(self) -> str:
        """One line (print(result) once dumped ~55 KB of modules): the model, what was
        applied, the verdict with its max_abs and cosine, and the saved variant's speed-up."""
        n = len(self.plan.decisions)
        applied = f"applied {len(self.applied)} of {n} decision{'s' if n != 1 else ''}"
        if self.rolled_back:
            applied += f", {len(self.rolled_back)} rolled back"
        v = self.verification
        verdict = (f"verification {'PASSED' if v.passed else 'FAILED'} "
                   f"(max_abs {v.max_abs:.3g}, cosine {v.cosine:.6f})")
        best = next((t for t in self.variants if t.name == self.best), None)
        if best is None or best.speedup_vs_input is None:
            timed = "not timed"
        else:
            timed = f"best {self.best} {best.speedup_vs_input:.2f}x the input"
        return f"Result(model={self.model!r}, target={self.target!r}, {applied}, {verdict}, {timed})"

    @property
    def _saved_kind(self) -> str:
        return _SAVES.get(self.best, "candidate")

    @property
    def saved_artifact(self):
        """The backends.pt2.Artifact written as model.pt2 (the file the race timed), or None
        when there was no race or the winner's graph did not export."""
        art = self.artifacts.get("candidate" if self._saved_kind == "candidate" else "input")
        return art if art is not None and art.path is not None else None

    @property
    def saved_module(self) -> nn.Module:
        """The module saved as model.pt2: the winner of the race as reloaded from the file
        that was timed; the input itself when nothing opswap made beat it."""
        art = self.saved_artifact
        if art is not None and art.module is not None:
            return art.module
        return self.candidate if self._saved_kind == "candidate" else self.reference

    def deploy(self) -> dict[str, Any]:
        """What model.pt2 holds and how to run it."""
        kind = self._saved_kind
        compiled = self.best.endswith("compile")
        holds = {"input": "your model, unchanged (as exported; its time is the `captured` "
                          "row): nothing opswap made beat your model in this run",
                 "captured": "your model as exported, with no rewrite",
                 "candidate": "opswap's optimized model"}[kind]
        how = "opswap.load_optimized(DIR)" + (" (compiles it with torch.compile)"
                                              if compiled else "")
        if kind == "input":
            cap = next((v for v in self.variants if v.name == "captured" and v.ms is not None), None)
            if cap is not None and cap.slower:
                # The file is the input as exported; where that export ran slower than the
                # module itself, the module is what to keep.
                holds += (f"; as exported it ran at {cap.speedup_vs_input:.2f}x of your module, "
                          "so keep running your own module")
                how = "your own module, as it is (model.pt2 is its slower export)"
        verified_as = self.verified_as
        if not self.variants:  # no race: what is saved is the candidate verified in memory
            verified_as = {"variant": "opswap (in memory, before export; not raced)",
                           "shapes": list(getattr(self.verification, "shapes", []) or [])}
        artifact = "model.pt2"
        if self.variants and verified_as is None:
            artifact = None
            holds = ("nothing: the file your model's export would be (the `captured` row) "
                     "did not pass verification, so no model.pt2 is written")
            how = "your own module, as it is"
        return {"variant": self.best, "artifact": artifact, "holds": holds,
                "compile": compiled, "how": how, "timed": self.saved_artifact is not None,
                "verified_as": verified_as, "run_under": "torch.inference_mode()"}

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        """Write plan.json, result.json, report.md, report.html and the optimized model.
        `out_dir` then holds exactly this run: it is written beside it and swapped in, and
        the files an earlier run wrote there are removed (report.run_folder)."""
        from opswap.report.run_folder import write_run

        return write_run(out_dir, self._write)

    def _write(self, out: Path) -> dict[str, Path]:
        from opswap.report import write_reports
        from opswap.report.model_io import save_model

        paths = {"plan": self.plan.save(out / "plan.json")}
        if not self.variants or self.verified_as is not None:
            # only a file that passed verification at every shape it claims is saved
            artifact = self.saved_artifact
            if artifact is None:  # no race: exported here, and the claim follows the file
                from opswap.backends.pt2 import export_artifact

                artifact = export_artifact(self.saved_module, tuple(self.example_inputs),
                                           self.dynamic, out)
                self.dynamic = file_claim(self.dynamic, artifact, self.notes)
            paths.update(save_model(self.saved_module, self.example_inputs, self.plan, out,
                                    dynamic=self.dynamic, artifact=artifact))
        data = self.to_json()
        data["model_files"] = {k: str(v.name) for k, v in paths.items() if k != "plan"}
        paths["result"] = out / "result.json"
        paths["result"].write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
        paths.update(write_reports(self, out))
        return paths


def _version() -> str:
    from opswap import __version__

    return __version__


def _json_default(o):
    if isinstance(o, float | int):
        return o
    if isinstance(o, torch.dtype):
        return str(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def _totals(analysis) -> dict[str, Any] | None:
    if analysis is None:
        return None
    return {"total_flops": analysis.total_flops, "total_bytes": analysis.total_bytes,
            "est_time_s": analysis.est_time_s, "ops": len(analysis.rows)}


def _to_device(model: nn.Module, example_inputs, device: str):
    """The (private) model and the inputs on `device`."""
    from torch.utils import _pytree as pytree

    if device.startswith("cuda") and not torch.cuda.is_available():
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


def file_claim(dynamic, artifact, notes: list[str]):
    """The axes the saved file keeps dynamic: `dynamic` less those torch.export specialised
    in `artifact` (a backends.pt2.Artifact), with a note when it is narrower."""
    kept = getattr(artifact, "kept", None)
    if dynamic is None or kept is None or len(kept.axes) >= len(dynamic.axes):
        return dynamic
    if artifact.note and artifact.note not in notes:
        notes.append(artifact.note + " (the optimized module in memory takes them dynamic)")
    return kept


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
    def replan(without=frozenset()):
        return make_plan(captured, target=plan.settings.target, rules=plan.settings.rules,
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


# --------------------------------------------------------------------------- the stages


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

    def replan(self, without: set[str] | frozenset[str] = frozenset()) -> Plan:
        """A plan made afresh, without the excluded rules and sites and `without`'s rules."""
        return make_plan(self.captured, target=self.target, rules=self.config.rules,
                         exactness=self.config.exactness, model_name=self.name,
                         exclude_rules=self.excluded_rules | set(without),
                         exclude_sites=self.excluded_sites)

    def check(self, fn, variants=None) -> Verification:
        """`fn` against the model itself, not only its capture, at every shape the capture
        claims (or at `variants`' shapes)."""
        return verify(self.reference, fn, self.captured.example_inputs,
                      samples=self.config.samples, tolerance=self.tolerance,
                      seed=self.config.seed,
                      variants=self.captured.variants() if variants is None else variants)


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


@dataclass
class Raced:
    """The race of variants (None with bench off), the sizes the saved file keeps
    dynamic, and the notes the race left."""

    race: Race | None
    dynamic: Any
    notes: list[str] = field(default_factory=list)


def capture_stage(model: nn.Module, example_inputs, config: OptimizeConfig, name: str,
                  step: Callable[[str], None]) -> Run:
    """The private reference (on `config.device`) and its capture, with the target and the
    tolerance resolved once for every later stage."""
    target = get_target(config.target)
    hooks = user_hooks(model)
    if hooks and config.keep_hooks:
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
    captured = capture(model, example_inputs, dynamic=config.dynamic)
    tol = tolerance_for(config.exactness, config.budget, captured.rounding)
    return Run(config, name, target, model, captured, tol, hooks)


def plan_and_verify(run: Run, step: Callable[[str], None]) -> Checked:
    """Plan, apply and verify; while verification fails, bisect to the sites that break it,
    take them out and plan again, so that sites depending on a rolled-back one are
    matched afresh."""
    step("plan")
    plan = run.replan()
    step("apply")
    applied = apply_plan(run.captured, plan)
    step("verify")
    out = Checked(plan, applied, run.check(applied.gm))
    for _ in range(_MAX_REPLANS):
        if out.verification.passed or not run.config.rollback or not out.plan.decisions:
            break
        step("rollback")
        _, removed = rollback(run.captured, out.plan, run.reference, run.tolerance,
                              samples=run.config.samples, seed=run.config.seed)
        if not removed:
            break
        for r in removed:
            run.excluded_sites[(r.decision.rule, r.decision.site.key)] = f"rolled back: {r.reason}"
        plan = run.replan()
        applied = apply_plan(run.captured, plan)
        out = Checked(plan, applied, run.check(applied.gm), out.rolled_back + removed)
    return out


def prune(run: Run, checked: Checked, step: Callable[[str], None]) -> Pruned:
    """Time the result without each rule (when timing is on and it passed), and drop the
    rules it measures faster without, if the plan without them passes too."""
    out = Pruned(checked.plan, checked.applied, checked.verification, checked.rolled_back)
    config = run.config
    if not (config.bench and config.measure_rules and checked.applied.applied
            and checked.verification.passed):
        return out
    step("measure")
    out.attribution = _attribute(run.captured, checked.plan, checked.applied, run.replan,
                                 config.device)
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
        plan.skipped.append({
            "rule": t.rule, "key": f"all {t.sites} site{'s' if t.sites != 1 else ''}",
            "reason": f"measured slower on {t.device}: {t.with_ms:.3f} ms with it, "
                      f"{t.without_ms:.3f} ms without (interval of the ratio "
                      f"{t.ci_low:.2f}-{t.ci_high:.2f})"})
    out.plan, out.applied, out.verification = plan, applied, verification
    out.pruned_rules = {t.rule for t in slow}
    out.attribution.note = ("measured before pruning " + ", ".join(t.rule for t in slow)
                            + ", which the model ran faster without")
    return out


def race(run: Run, pruned: Pruned, step: Callable[[str], None]) -> Raced:
    """Race opswap's result against the input and `config.compare`'s baselines, each
    verified at the sizes it claims; the winner is what the run saves."""
    if not run.config.bench:
        return Raced(None, run.captured.dynamic)
    from opswap.graph.dynamic import variants as at_sizes

    step("race")

    def check_variant(fn, shapes):
        # shapes: the Dynamic whose sizes the variant claims (a file's own), or False
        return run.check(fn, at_sizes(run.captured.example_inputs, shapes) if shapes else ())

    raced = run_variants(run.reference, run.captured, pruned.applied.gm, check_variant,
                         compare=parse_compare(run.config.compare), device=run.config.device)
    notes: list[str] = []
    saved = raced.artifacts.get("candidate" if _SAVES.get(raced.winner.name) == "candidate"
                                else "input")
    dynamic = file_claim(run.captured.dynamic, saved, notes)
    if pruned.attribution is not None:
        # one scale for the report: the total is the race's, shared among the rules kept
        reconcile(pruned.attribution, raced.result, pruned.pruned_rules)
    return Raced(raced, dynamic, notes)


def optimize(
    model: nn.Module,
    example_inputs,
    config: OptimizeConfig | None = None,
    *,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
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
    from opswap.cost.analyze import analyze
    from opswap.verify.layers import compare_layers

    config = config or OptimizeConfig()
    step = progress or (lambda stage: None)
    run = capture_stage(model, example_inputs, config, name or type(model).__name__, step)
    step("analyze")
    before = analyze(run.captured, run.target)
    checked = plan_and_verify(run, step)
    pruned = prune(run, checked, step)
    layers = None
    if config.layers:
        step("layers")
        layers = compare_layers(run.captured, pruned.applied, run.captured.example_inputs)
    after = analyze(pruned.applied.captured, run.target)
    raced = race(run, pruned, step)
    return _result(run, pruned, raced, before, after, layers,
                   _run_info(run.reference, run.captured, config, model_settings))


def _result(run: Run, pruned: Pruned, raced: Raced, before, after, layers,
            run_info: dict[str, Any]) -> Result:
    """The stages' values gathered into one Result."""
    r, hooks = raced.race, run.hooks
    return Result(
        model=run.name, target=run.target.name, config=run.config, reference=run.reference,
        candidate=guarded(pruned.applied.gm, run.captured, run.reference),
        example_inputs=run.captured.example_inputs, plan=pruned.plan,
        applied=pruned.applied.applied, failed=pruned.plan.failed + pruned.applied.failed,
        rolled_back=pruned.rolled_back, verification=pruned.verification,
        analysis_before=before, analysis_after=after, layers=layers,
        benchmark=r.benchmark if r else None,
        rule_timings=pruned.attribution.rules if pruned.attribution is not None else [],
        attribution=pruned.attribution,
        notes=([f"The model has {describe_hooks(hooks)}; opswap verified, optimized and "
                "timed a copy without them (keep_hooks=True refuses the model instead)."]
               if hooks else []) + list(run.captured.notes) + list(pruned.plan.notes)
              + raced.notes,
        dynamic=raced.dynamic, variants=r.timings if r else [],
        best=r.winner.name if r else "opswap", captured_gm=run.captured.gm,
        artifacts=r.artifacts if r else {}, verified_as=r.verified_as if r else None,
        settled=r.settled if r else None, run_info=run_info,
    )
