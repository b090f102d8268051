"""The whole flow in one place: load -> capture -> analyze -> plan -> apply -> verify -> bench.

Each stage is a plain function of the previous stage's value; `optimize` strings
them together, rolls back sites that break the accuracy budget, and returns a
`Result` that can write plan.json, result.json, the report and the model.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opswap.bench.variants import parse_compare
from opswap.bench.variants import run as run_variants
from opswap.graph.capture import Captured, capture
from opswap.graph.copies import count_hooks, private_copy
from opswap.rules.base import EXACTNESS_ORDER, Site
from opswap.search.plan import Plan, apply_plan, make_plan


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
    prune_slow: bool = True  # when the result is slower, drop the rules that measure slower
    device: str = "cpu"
    dynamic: str = "auto"  # input sizes kept symbolic: auto, none, batch, seq, I:D=name,...
    compare: str = "compile"  # baselines raced beside opswap's result: compile, or none
    keep_hooks: bool = False  # run the copies opswap times and verifies with the user's hooks


# which module a winning variant saves
_SAVES = {"input": "input", "compile": "input", "captured": "captured"}


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
    rule_timings: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dynamic: Any = None  # graph.dynamic.Dynamic: the sizes the saved model keeps symbolic
    variants: list[Any] = field(default_factory=list)  # bench.variants.VariantTiming, raced
    best: str = "opswap"  # the variant saved: input, captured, opswap, compile, opswap+compile
    captured_gm: Any = None  # the capture with no rewrite (saved when `captured` wins)
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
            "variants": [v.to_json() for v in self.variants],
            "best": self.best,
            "deploy": self.deploy(),
            "analysis": {
                "before": _totals(self.analysis_before),
                "after": _totals(self.analysis_after),
            },
            "notes": self.notes,
        }

    @property
    def saved_module(self) -> nn.Module:
        """The module saved as model.pt2: the winner of the race (the input itself when
        nothing opswap made beat it)."""
        kind = _SAVES.get(self.best, "candidate")
        if kind == "input":
            return self.reference
        if kind == "captured" and self.captured_gm is not None:
            return self.captured_gm
        return self.candidate

    def deploy(self) -> dict[str, Any]:
        """What model.pt2 holds and how to run it."""
        kind = _SAVES.get(self.best, "candidate")
        compiled = self.best.endswith("compile")
        holds = {"input": "your model, unchanged: nothing opswap made beat it in this run",
                 "captured": "opswap's capture of your model, with no rewrite",
                 "candidate": "opswap's optimized model"}[kind]
        how = "torch.export.load(path).module()" + (", then torch.compile it" if compiled else "")
        return {"variant": self.best, "artifact": "model.pt2", "holds": holds,
                "compile": compiled, "how": how}

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        """Write plan.json, result.json, report.md, report.html and the optimized model."""
        from opswap.report import write_reports
        from opswap.report.model_io import save_model

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"plan": self.plan.save(out / "plan.json")}
        paths.update(save_model(self.saved_module, self.example_inputs, self.plan, out,
                                dynamic=self.dynamic))
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


@dataclass
class RuleTiming:
    """What one rule's sites are worth, measured: the model timed with and without them."""

    rule: str
    sites: int
    predicted_saved_s: float
    with_ms: float
    without_ms: float
    device: str
    # quartiles of the per-round ratio (time without the rule) / (time with it)
    ratio_q1: float | None = None
    ratio_q3: float | None = None

    @property
    def measured_saved_s(self) -> float:
        return (self.without_ms - self.with_ms) / 1e3

    @property
    def pays(self) -> bool:
        """False only when the model is faster without the rule beyond the run's noise:
        in three rounds of four (the per-round ratio's upper quartile below 1), or, with no
        quartiles, by more than 2 % in the medians."""
        if self.ratio_q3 is not None:
            return self.ratio_q3 >= 1.0
        return self.without_ms * 1.02 >= self.with_ms

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "sites": self.sites,
                "predicted_saved_s": self.predicted_saved_s,
                "measured_saved_s": self.measured_saved_s, "with_ms": self.with_ms,
                "without_ms": self.without_ms, "ratio_quartiles": [self.ratio_q1, self.ratio_q3],
                "pays": self.pays, "device": self.device}


def _without(plan: Plan, rule: str) -> Plan:
    import copy

    trial = copy.copy(plan)
    trial.decisions = [d for d in plan.decisions if d.rule != rule]
    trial.skipped = list(plan.skipped)
    return trial


def measure_rules(captured: Captured, plan: Plan, applied, device: str = "cpu",
                  min_time_s: float = 0.3) -> list[RuleTiming]:
    """Time the optimized model against itself minus each rule's sites, interleaved.

    This is the measured counterpart of each rule's `predict`: the cost model cannot
    see dispatch overheads or which kernel a library picks, the clock can.
    """
    from opswap.bench.timing import bench_models

    out = []
    for rule in dict.fromkeys(d.rule for d in plan.decisions):
        trial = _without(plan, rule)
        candidate = apply_plan(captured, trial)
        b = bench_models(candidate.gm, applied.gm, captured.example_inputs, device=device,
                         memory=False, min_time_s=min_time_s)
        mine = [d for d in plan.decisions if d.rule == rule]
        out.append(RuleTiming(rule, len(mine), sum(d.estimate.time_saved_s or 0.0 for d in mine),
                              b.opt_ms, b.ref_ms, b.device, b.speedup_q1, b.speedup_q3))
    return out


def _prune_slow(captured: Captured, plan: Plan, timings: list[RuleTiming]):
    """Drop every rule the model measured faster without. Returns (plan, applied) or None."""
    slow = [t for t in timings if not t.pays]
    if not slow:
        return None
    for t in slow:
        plan = _without(plan, t.rule)
        plan.skipped.append({
            "rule": t.rule, "key": f"all {t.sites} sites",
            "reason": f"measured slower on {t.device}: {t.with_ms:.3f} ms with it, "
                      f"{t.without_ms:.3f} ms without"})
    return plan, apply_plan(captured, plan)


def optimize(
    model: nn.Module,
    example_inputs,
    config: OptimizeConfig | None = None,
    *,
    name: str | None = None,
    progress=None,
) -> Result:
    """Run the whole flow on `model` and return a Result.

    The user's module is never called nor changed: opswap captures, verifies against and
    times a private copy of it (without the user's hooks unless `config.keep_hooks`).
    `progress(stage: str)` is called as each stage starts, for progress bars.
    """
    from opswap.bench.timing import bench_models
    from opswap.cost.analyze import analyze
    from opswap.targets import get_target
    from opswap.verify.bisect import rollback
    from opswap.verify.layers import compare_layers
    from opswap.verify.outputs import verify

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
    target = get_target(config.target)
    _tolerance(config)  # parse the budget and the baselines before any long work
    compare = parse_compare(config.compare) if config.bench else []
    hooks = count_hooks(model)
    model = private_copy(model, keep_hooks=config.keep_hooks)  # the reference opswap runs
    if config.device != "cpu":
        # time and verify where the user deploys; the user's module stays where it is
        model, example_inputs = _to_device(model, example_inputs, config.device)
    step("capture")
    captured: Captured = capture(model, example_inputs, dynamic=config.dynamic)
    tol = _tolerance(config, captured.rounding)
    step("analyze")
    before = analyze(captured, target)
    step("plan")
    plan = make_plan(captured, target=target, rules=config.rules, exactness=config.exactness,
                     model_name=name)
    step("apply")
    applied = apply_plan(captured, plan)
    step("verify")
    def check(candidate) -> Any:
        # against the model itself, not only its capture, at every shape the capture claims
        return verify(model, candidate.gm, captured.example_inputs, samples=config.samples,
                      tolerance=tol, seed=config.seed, variants=captured.variants())

    verification = check(applied)
    rolled_back: list[Any] = []
    if not verification.passed and config.rollback and plan.decisions:
        step("rollback")
        plan, rolled_back = rollback(captured, plan, model, tol,
                                     samples=config.samples, seed=config.seed)
        applied = apply_plan(captured, plan)
        verification = check(applied)
    bench = None
    timings: list[RuleTiming] = []
    if config.bench:
        step("bench")
        bench = bench_models(model, applied.gm, captured.example_inputs, device=config.device)
        if config.measure_rules and applied.applied:
            step("measure")
            timings = measure_rules(captured, plan, applied, device=config.device)
        if config.prune_slow and timings and not all(t.pays for t in timings):
            step("prune")
            pruned = _prune_slow(captured, plan, timings)
            if pruned is not None:
                plan, applied = pruned
                verification = check(applied)
                bench = bench_models(model, applied.gm, captured.example_inputs,
                                     device=config.device)
                # the kept rules' timings were taken against the unpruned model: close enough
                # to show, and the whole model's figure above is fresh
                timings = [t for t in timings if t.pays]
    layers = None
    if config.layers:
        step("layers")
        layers = compare_layers(captured, applied, captured.example_inputs)
    after = analyze(applied.captured, target)
    raced: list[Any] = []
    winner = "opswap"
    if config.bench:
        step("race")

        def check_variant(fn, shapes: bool):
            return verify(model, fn, captured.example_inputs, samples=config.samples,
                          tolerance=tol, seed=config.seed,
                          variants=captured.variants() if shapes else ())

        raced, chosen = run_variants(model, captured, applied.gm, verification, check_variant,
                                     compare=compare, device=config.device)
        winner = chosen.name
    return Result(
        model=name,
        target=target.name,
        config=config,
        reference=model,
        candidate=applied.gm,
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
        rule_timings=timings,
        notes=([f"The model has {hooks} forward/backward hook(s); opswap verified and timed a "
                "copy without them (keep_hooks=True keeps them)."] if hooks and not
               config.keep_hooks else []) + list(captured.notes),
        dynamic=captured.dynamic,
        variants=raced,
        best=winner,
        captured_gm=captured.gm,
    )
