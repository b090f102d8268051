"""The whole flow in one place: capture -> analyze -> plan and verify -> prune -> race.

`optimize` is a driver that reads as its list of stages (opswap.stages: each a function
of the run's settings and the previous stages' values, returning a typed value). The
result is a `Result` that can write plan.json, result.json, the report and the model.
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

from opswap.bench.attribution import Attribution
from opswap.bench.timing import check_device
from opswap.bench.variants import parse_compare
from opswap.errors import RuleError, VerificationError
from opswap.graph.capture import Captured
from opswap.graph.copies import describe_hooks
from opswap.planner import Plan, make_plan
from opswap.rules.base import EXACTNESS_ORDER, Site
from opswap.rules.registry import parse_patterns
from opswap.stages import (
    Pruned,
    Run,
    capture_stage,
    file_claim,
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
        check_device(self.device)  # so do a device name and CUDA without a GPU
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


def measure_rules(captured: Captured, plan: Plan, applied, *, device: str = "cpu",
                  min_time_s: float = 0.5) -> Attribution:
    """Leave-one-out timing of every rule `applied` (the result of `apply_plan(captured,
    plan)`) carried out: each candidate without one rule is planned again with the plan's
    own settings, and all are timed in one run (bench.attribution)."""
    def replan(without=frozenset()):
        return make_plan(captured, target=plan.settings.target, rules=plan.settings.rules,
                         exactness=plan.settings.exactness, exclude_rules=set(without))

    return leave_one_out(captured, plan, applied, replan, device, min_time_s)


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
                   run_info(run.reference, run.captured, config, model_settings))


def _result(run: Run, pruned: Pruned, raced, before, after, layers,
            info: dict[str, Any]) -> Result:
    """The stages' values gathered into one Result; `raced` is the race, None untimed."""
    dynamic, notes = run.captured.dynamic, []
    if raced is not None:
        saved = raced.artifacts.get("candidate" if _SAVES.get(raced.winner.name) == "candidate"
                                    else "input")
        dynamic = file_claim(dynamic, saved, notes)
    hooks = run.hooks
    return Result(
        model=run.name, target=run.target.name, config=run.config, reference=run.reference,
        candidate=guarded(pruned.applied.gm, run.captured, run.reference),
        example_inputs=run.captured.example_inputs, plan=pruned.plan,
        applied=pruned.applied.applied, failed=pruned.plan.failed + pruned.applied.failed,
        rolled_back=pruned.rolled_back, verification=pruned.verification,
        analysis_before=before, analysis_after=after, layers=layers,
        benchmark=raced.benchmark if raced else None,
        rule_timings=pruned.attribution.rules if pruned.attribution is not None else [],
        attribution=pruned.attribution,
        notes=([f"The model has {describe_hooks(hooks)}; opswap verified, optimized and "
                "timed a copy without them (keep_hooks=True refuses the model instead)."]
               if hooks else []) + list(run.captured.notes) + list(pruned.plan.notes) + notes,
        dynamic=dynamic, variants=raced.timings if raced else [],
        best=raced.winner.name if raced else "opswap", captured_gm=run.captured.gm,
        artifacts=raced.artifacts if raced else {},
        verified_as=raced.verified_as if raced else None,
        settled=raced.settled if raced else None, run_info=info,
    )
