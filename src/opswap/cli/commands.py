"""The commands: each checks its arguments, calls one function of opswap.api and prints
what it returns (opswap.cli.render). A spec is loaded through `_load` here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from opswap import api
from opswap.cli import consoles, render
from opswap.cli.app import app, check_outputs, overrides

Spec = Annotated[
    str,
    typer.Argument(
        metavar="SPEC",
        help="Model: zoo:NAME, hf:TYPE, hf:PATH, torchvision:NAME, "
        "timm:NAME, file.py:function or model.pt2.",
    ),
]
PlanArg = Annotated[Path, typer.Argument(metavar="PLAN", help="plan.json from `opswap plan`.")]
TargetOpt = Annotated[
    str,
    typer.Option(
        "--target", "-t", metavar="TARGET", help="Hardware target (cpu, h100, h200, a100)."
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="KEY=VALUE", help="Model override (repeatable)."),
]
WeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--weights",
        "-w",
        metavar="FILE",
        help="Weights for the spec's architecture: a .safetensors file or a torch.save state dict (read with weights_only=True).",
    ),
]
JsonOpt = Annotated[
    Path | None,
    typer.Option("--json", metavar="PATH", help="Also write machine-readable output here."),
]
RulesOpt = Annotated[
    str | None,
    typer.Option(
        "--rules",
        "-r",
        metavar="GLOBS",
        help="Comma-separated rule globs, e.g. 'fusion.*,layout.drop_*'.",
    ),
]
ExactOpt = Annotated[
    str,
    typer.Option(
        "--exactness", "-e", metavar="CLASS", help="Loosest rules allowed: exact, approx or lossy."
    ),
]
RulesFromOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rules-from",
        metavar="MODULE",
        help="Also load the rules @register'ed in this Python module (a name found on the Python path or in the current directory, or a .py file; repeatable). Installed packages add theirs through the opswap.rules entry-point group.",
    ),
]
DynamicOpt = Annotated[
    str,
    typer.Option(
        "--dynamic",
        metavar="SIZES",
        help="Input sizes kept symbolic: auto (batch and sequence, detected), none, batch, seq, or I:D=NAME items.",
    ),
]
_DEVICES = "cpu, cuda or cuda:N"
_STAGES = [
    "load",
    "capture",
    "analyze",
    "plan",
    "apply",
    "verify",
    "rollback",
    "bench",
    "measure",
    "prune",
    "layers",
    "race",
    "report",
]


def _load(spec: str, sets: list[str] | None, weights: Path | None = None):
    """api.load, saying when the model was put in eval mode and which weights it read."""
    from opswap.models.weights import describe_record

    loaded = api.load(spec, str(weights) if weights is not None else None, **overrides(sets))
    if loaded.settings.get("mode", "").startswith("eval:"):
        render.line(
            f"note: {spec} was put in eval mode ({loaded.settings['mode'][6:]}); "
            "opswap.optimize on a module keeps the mode it is given."
        )
    if loaded.settings.get("weights"):
        render.line(describe_record(loaded.settings["weights"]))
    return loaded


def _rules_from(modules: list[str] | None) -> None:
    for problem in api.load_rules(modules):
        render.note(problem, "plugin")


def _timed_where(target: str, device: str) -> None:
    text = api.timing_note(target, device)
    if text:
        render.note(text, "timing")


@app.command()
def analyze(
    spec: Spec,
    target: TargetOpt = "cpu",
    sets: SetOpt = None,
    json_path: JsonOpt = None,
    dynamic: DynamicOpt = "auto",
    weights: WeightsOpt = None,
    top: Annotated[int, typer.Option(metavar="N", help="Rows to show (all are in --json).")] = 40,
) -> None:
    """Per-op FLOPs, bytes, intensity and bound against a target; totals and bottlenecks."""
    from opswap.cost.analyze import render as render_analysis

    check_outputs(json_path)
    tgt = api.get_target(target)
    loaded = _load(spec, sets, weights)
    result = api.analyze(loaded.module, loaded.example_inputs, tgt, dynamic=dynamic, name=spec)
    for text in result.notes:
        render.note(text)
    render_analysis(result, consoles.console, top=top)
    render.write_json(json_path, result.to_json())


@app.command("rules")
def list_rules(
    json_path: JsonOpt = None,
    rules_from: RulesFromOpt = None,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide",
            help="Print every rule's whole description, wrapped to the terminal's width, instead of the table's first sentence.",
        ),
    ] = False,
) -> None:
    """Every rule: name, family, chapter, exactness, targets, what it does, and where it came
    from when not from opswap itself (--rules-from, an installed package)."""
    check_outputs(json_path)
    _rules_from(rules_from)
    rows = api.list_rules()
    render.rules(rows, wide)
    render.write_json(json_path, rows)


@app.command()
def models(json_path: JsonOpt = None) -> None:
    """The built-in zoo and the Hugging Face model types `hf:` builds from a config."""
    check_outputs(json_path)
    data = api.list_models()
    render.models(data)
    render.write_json(json_path, data)


@app.command()
def plan(
    spec: Spec,
    target: TargetOpt = "cpu",
    rules: RulesOpt = None,
    exactness: ExactOpt = "exact",
    sets: SetOpt = None,
    dynamic: DynamicOpt = "auto",
    out: Annotated[
        Path, typer.Option("--out", "-o", metavar="FILE", help="Where to write the plan.")
    ] = Path("plan.json"),
    weights: WeightsOpt = None,
    rules_from: RulesFromOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Match the rules on a model and write plan.json (sites chosen, misses, settings)."""
    check_outputs(json_path, out)
    _rules_from(rules_from)
    loaded = _load(spec, sets, weights)
    p = api.plan(
        loaded.module,
        loaded.example_inputs,
        target=target,
        rules=rules,
        exactness=exactness,
        dynamic=dynamic,
        name=spec,
    )
    render.plan(p)
    p.save(out)
    render.line(f"wrote {out}")
    render.write_json(json_path, p.to_json())


@app.command()
def apply(
    spec: Spec,
    plan_path: PlanArg,
    sets: SetOpt = None,
    dynamic: DynamicOpt = "auto",
    weights: WeightsOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", metavar="DIR", help="Save the optimized model in this directory."
        ),
    ] = None,
    rules_from: RulesFromOpt = None,
    allow_looser: Annotated[
        bool,
        typer.Option(
            "--allow-looser",
            help="Apply decisions whose rule is looser than the plan's exactness (an approx rule in an exact plan); refused otherwise.",
        ),
    ] = False,
    json_path: JsonOpt = None,
) -> None:
    """Re-apply a plan to a model; optionally save the optimized model. Exit status 1 when
    decisions of the plan could not be applied (the model is saved without them); 2 when a
    decision's rule is looser than the plan's exactness and --allow-looser is not given."""
    check_outputs(json_path, out, out_dir=True)
    _rules_from(rules_from)
    p = api.read_plan(plan_path, allow_looser=allow_looser)  # a refusal costs no loading
    loaded = _load(spec, sets, weights)
    done = api.replay(
        loaded.module, loaded.example_inputs, p, dynamic=dynamic, allow_looser=allow_looser, out=out
    )
    render.not_applied(done.applied)
    consoles.console.print(
        f"applied {len(done.applied.applied)} of {render.n(len(p.decisions), 'decision')}"
    )
    render.inputs(loaded.module)
    if out is not None:
        render.line(f"saved {done.files['model']}")
    render.partial(
        p,
        done.applied,
        f"saved {done.files['model']} with the {{n}} that did"
        if out is not None
        else "nothing was saved (no --out)",
    )
    render.write_json(
        json_path,
        {
            "applied": [s.to_json() for s in done.applied.applied],
            "failed": [f.to_json() for f in done.applied.failed],
        },
    )
    if done.applied.failed:
        raise typer.Exit(1)


@app.command()
def verify(
    spec: Spec,
    plan_path: PlanArg,
    budget: Annotated[
        str | None,
        typer.Option(
            metavar="METRIC>=X", help="e.g. 'cosine>=0.9999' (default: from the plan's exactness)."
        ),
    ] = None,
    samples: Annotated[int, typer.Option(metavar="N", help="Random input samples.")] = 3,
    sets: SetOpt = None,
    dynamic: DynamicOpt = "auto",
    weights: WeightsOpt = None,
    rules_from: RulesFromOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Compare the plan's result with the original; exit 1 when it breaks the tolerance or
    decisions of the plan could not be applied."""
    check_outputs(json_path)
    _rules_from(rules_from)
    p = api.read_plan(plan_path)
    loaded = _load(spec, sets, weights)
    check = api.verify_plan(
        loaded.module, loaded.example_inputs, p, budget=budget, samples=samples, dynamic=dynamic
    )
    render.not_applied(check.replay.applied)
    render.verification(check, budget, samples)
    render.inputs(loaded.module)
    render.partial(p, check.replay.applied, "verified the model with the {n} that did")
    render.write_json(json_path, check.verification.to_json())
    if not check.verification.passed or check.replay.applied.failed:
        raise typer.Exit(1)


@app.command()
def bench(
    spec: Spec,
    plan_path: PlanArg,
    device: Annotated[
        str, typer.Option(metavar="DEVICE", help=f"Where to time: {_DEVICES}.")
    ] = "cpu",
    sets: SetOpt = None,
    dynamic: DynamicOpt = "auto",
    weights: WeightsOpt = None,
    rules_from: RulesFromOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Time the original and the plan's result side by side (interleaved, after warm-up).
    Exit status 1 when decisions of the plan could not be applied (the rest is timed)."""
    check_outputs(json_path)
    api.check_device(device)
    _rules_from(rules_from)
    p = api.read_plan(plan_path)
    _timed_where(p.settings.target, device)
    loaded = _load(spec, sets, weights)
    timed = api.bench_plan(loaded.module, loaded.example_inputs, p, device=device, dynamic=dynamic)
    render.not_applied(timed.replay.applied)
    data = timed.benchmark.to_json()
    render.bench(data)
    render.partial(p, timed.replay.applied, "timed the model with the {n} that did")
    render.write_json(json_path, data)
    if timed.replay.applied.failed:
        raise typer.Exit(1)


@app.command()
def optimize(
    spec: Spec,
    target: TargetOpt = "cpu",
    rules: RulesOpt = None,
    exactness: ExactOpt = "exact",
    budget: Annotated[
        str | None,
        typer.Option(metavar="METRIC>=X", help="Accuracy budget, e.g. 'cosine>=0.9999'."),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", "-o", metavar="DIR", help="Output directory.")
    ] = Path("opswap-out"),
    samples: Annotated[
        int, typer.Option(metavar="N", help="Random input samples for verification.")
    ] = 3,
    no_bench: Annotated[bool, typer.Option("--no-bench", help="Skip timing.")] = False,
    device: Annotated[
        str, typer.Option(metavar="DEVICE", help=f"Where to run and time: {_DEVICES}.")
    ] = "cpu",
    dynamic: DynamicOpt = "auto",
    compare: Annotated[
        str,
        typer.Option(
            "--compare",
            metavar="BASELINES",
            help="Baselines raced in the same run: compile (torch.compile of the input and of opswap's result), or none.",
        ),
    ] = "compile",
    sets: SetOpt = None,
    weights: WeightsOpt = None,
    rules_from: RulesFromOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """The whole flow: analyze, plan, apply, verify (with rollback), bench, report. Exit
    status 1 when the result fails verification (what was saved is printed)."""
    check_outputs(json_path, out, out_dir=True)
    config = api.OptimizeConfig(
        target=target,
        rules=rules or [],
        exactness=exactness,
        budget=budget,
        samples=samples,
        bench=not no_bench,
        device=device,
        dynamic=dynamic,
        compare=compare,
    )
    _rules_from(rules_from)
    if not no_bench:
        _timed_where(target, device)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=consoles.err,
        transient=True,
    ) as progress:
        task = progress.add_task("load", total=len(_STAGES))

        def step(stage: str) -> None:
            done = _STAGES.index(stage) if stage in _STAGES else None
            progress.update(task, description=stage, completed=done)

        loaded = _load(spec, sets, weights)
        result = api.optimize_loaded(loaded, config, name=spec, progress=step)
        step("report")
        paths = result.save(out)
    data = result.to_json()
    render.summary(data)
    for k in ("plan", "result", "report_md", "report_html", "model"):
        if k in paths:
            render.line(f"  {k:<11} {paths[k]}")
    render.inputs(loaded.module)
    render.write_json(json_path, data)
    if not data["verification"]["passed"]:
        render.note(
            f"opswap's result did not pass verification ({'; '.join(data['verification']['reasons'])}); "
            f"{paths.get('model', out)} holds {data['deploy']['holds']}; exit status 1.",
            "failed",
            "red",
        )
        raise typer.Exit(1)
