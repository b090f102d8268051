"""The `opswap` command: parses arguments, calls the Python API, prints.

Every command has --help; commands that produce data take --json PATH.
Errors opswap raises on purpose print as one line and exit with status 2.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from opswap.errors import OpswapError
from opswap.graph.copies import private_copy

app = typer.Typer(
    name="opswap",
    help="Operator replacement for PyTorch models: find the costly ops, swap them, "
    "prove the numbers match, measure the gain.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# piped output (CI logs, files) gets a wide fixed width instead of rich's 80 columns
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)

Spec = Annotated[str, typer.Argument(help="Model: zoo:NAME, hf:TYPE, hf:PATH, torchvision:NAME, "
                                          "timm:NAME, file.py:function or model.pt2.")]
TargetOpt = Annotated[str, typer.Option("--target", "-t", help="Hardware target (cpu, h100, h200, a100).")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Model override KEY=VALUE (repeatable).")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write machine-readable output here.")]
RulesOpt = Annotated[str | None, typer.Option("--rules", "-r", help="Comma-separated rule globs, e.g. 'fusion.*,layout.drop_*'.")]
ExactOpt = Annotated[str, typer.Option("--exactness", "-e", help="Loosest rules allowed: exact, approx or lossy.")]
DynamicOpt = Annotated[str, typer.Option("--dynamic", help="Input sizes kept symbolic: auto (batch and sequence, detected), none, batch, seq, or I:D=NAME items.")]
_DEVICES = "cpu, cuda or cuda:N"


def _version(value: bool) -> None:
    if value:
        from opswap import __version__

        typer.echo(f"opswap {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


def _overrides(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise OpswapError(f"--set takes KEY=VALUE; got {item!r}.")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _load(spec: str, sets: list[str] | None):
    from opswap.models import load

    return load(spec, _overrides(sets))


def _write_json(path: Path | None, data) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    console.print(f"[dim]wrote {path}[/dim]")


def _check_outputs(json_path: Path | None, out: Path | None = None, *, out_dir: bool = False) -> None:
    """Fail before any work when an output path cannot be written: a file where a directory
    goes, a directory where a file goes, or a file among its parents."""
    for opt, path, want_dir in (("--json", json_path, False), ("--out", out, out_dir)):
        if path is None:
            continue
        if want_dir and path.exists() and not path.is_dir():
            raise OpswapError(f"{opt} {path} is an existing file; name a directory (it is created if missing).")
        if not want_dir and path.is_dir():
            raise OpswapError(f"{opt} {path} is an existing directory; name a file to write.")
        parent = next((q for q in path.parents if q.exists()), None)
        if parent is not None and not parent.is_dir():
            raise OpswapError(f"{opt} {path} lies under {parent}, which is a file; name another path.")


def _check_device(device: str) -> None:
    """Fail before loading the model when --device names nothing opswap can run on."""
    from opswap.bench.timing import resolve_device

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise OpswapError(f"Unknown device {device!r}; use {_DEVICES}.")
    resolve_device(device)  # CUDA without a GPU


def _rule_patterns(rules: str | None) -> list[str]:
    return [p.strip() for p in rules.split(",") if p.strip()] if rules else []


@app.command()
def analyze(spec: Spec, target: TargetOpt = "cpu", sets: SetOpt = None, json_path: JsonOpt = None,
            dynamic: DynamicOpt = "auto",
            top: Annotated[int, typer.Option(help="Rows to show (all are in --json).")] = 40) -> None:
    """Per-op FLOPs, bytes, intensity and bound against a target; totals and bottlenecks."""
    from opswap.cost.analyze import analyze as _analyze
    from opswap.cost.analyze import render
    from opswap.graph import capture
    from opswap.targets import get_target

    _check_outputs(json_path)
    tgt = get_target(target)
    loaded = _load(spec, sets)
    captured = capture(loaded.module, loaded.example_inputs, dynamic=dynamic)
    for note in captured.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    result = _analyze(captured, tgt, model_name=spec)
    render(result, console, top=top)
    _write_json(json_path, result.to_json())


@app.command("rules")
def list_rules(json_path: JsonOpt = None) -> None:
    """Every rule: name, family, chapter, exactness, targets."""
    from opswap.rules.registry import all_rules

    _check_outputs(json_path)
    rows = [r.info() for r in all_rules()]
    table = Table(title=f"{len(rows)} rules")
    for col in ("name", "family", "ch.", "exactness", "targets", "what it does"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["name"], r["family"], str(r["chapter"]), r["exactness"],
                      ",".join(r["targets"]), r["description"].split("\n")[0][:90])
    console.print(table)
    _write_json(json_path, rows)


@app.command()
def models(json_path: JsonOpt = None) -> None:
    """The built-in zoo and the Hugging Face model types `hf:` builds from a config."""
    from opswap.models import list_hf_types, list_zoo

    _check_outputs(json_path)
    zoo = list_zoo()
    table = Table(title="zoo: (built-in reference models)")
    table.add_column("spec")
    table.add_column("chapters")
    table.add_column("what it holds", overflow="fold")
    for z in zoo:
        table.add_row(f"zoo:{z.name}", ",".join(map(str, z.chapters)), z.description)
    console.print(table)
    console.print("hf: " + ", ".join(f"hf:{t}" for t in list_hf_types()) + "  (random weights)")
    _write_json(json_path, {"zoo": [{"name": z.name, "description": z.description,
                                      "chapters": list(z.chapters)} for z in zoo],
                             "hf": list(list_hf_types())})


def _print_plan(plan) -> None:
    table = Table(title=f"plan: {len(plan.decisions)} replacements")
    for col in ("#", "rule", "site", "what", "pred. bytes saved", "pred. FLOPs saved"):
        table.add_column(col, overflow="fold")
    from opswap.cost.units import human, human_unit

    for i, d in enumerate(plan.decisions):
        table.add_row(str(i), d.rule, d.site.key, d.site.description,
                      human_unit(d.estimate.bytes_saved, "B"), human(d.estimate.flops_saved))
    console.print(table)
    if plan.misses:
        mt = Table(title=f"{len(plan.misses)} near misses")
        for col in ("rule", "where", "why not"):
            mt.add_column(col, overflow="fold")
        for m in plan.misses:
            mt.add_row(m.rule, m.where, m.reason)
        console.print(mt)
    for f in plan.failed:
        console.print(f"[red]failed[/red] {f.rule} at {f.key}: {f.reason}")
    for s in plan.skipped:
        console.print(f"[yellow]skipped[/yellow] {s['rule']} at {s['key']}: {s['reason']}")


@app.command()
def plan(spec: Spec, target: TargetOpt = "cpu", rules: RulesOpt = None,
         exactness: ExactOpt = "exact", sets: SetOpt = None, dynamic: DynamicOpt = "auto",
         out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the plan.")] = Path("plan.json"),
         json_path: JsonOpt = None) -> None:
    """Match the rules on a model and write plan.json (sites chosen, misses, settings)."""
    from opswap.graph import capture
    from opswap.search.plan import make_plan

    _check_outputs(json_path, out)
    loaded = _load(spec, sets)
    captured = capture(loaded.module, loaded.example_inputs, dynamic=dynamic)
    p = make_plan(captured, target=target, rules=_rule_patterns(rules), exactness=exactness,
                  model_name=spec)
    _print_plan(p)
    p.save(out)
    console.print(f"wrote {out}")
    _write_json(json_path, p.to_json())


def _applied(spec: str, plan_path: Path, sets, dynamic: str = "auto"):
    from opswap.graph import capture
    from opswap.search.plan import Plan, apply_plan

    p = Plan.load(plan_path)
    loaded = _load(spec, sets)
    captured = capture(loaded.module, loaded.example_inputs, dynamic=dynamic)
    applied = apply_plan(captured, p)
    for f in applied.failed:
        console.print(f"[red]not applied[/red] {f.rule} at {f.key}: {f.reason}")
    return loaded, captured, p, applied


@app.command()
def apply(spec: Spec, plan_path: Annotated[Path, typer.Argument(help="plan.json from `opswap plan`.")],
          sets: SetOpt = None, dynamic: DynamicOpt = "auto",
          out: Annotated[Path | None, typer.Option("--out", "-o", help="Save the optimized model in this directory.")] = None,
          json_path: JsonOpt = None) -> None:
    """Re-apply a plan to a model; optionally save the optimized model."""
    from opswap.report.model_io import save_model

    _check_outputs(json_path, out, out_dir=True)
    loaded, captured, p, applied = _applied(spec, plan_path, sets, dynamic)
    console.print(f"applied {len(applied.applied)} of {len(p.decisions)} decisions")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        files = save_model(applied.gm, captured.example_inputs, p, out, dynamic=captured.dynamic)
        console.print(f"saved {files['model']}")
    _write_json(json_path, {"applied": [s.to_json() for s in applied.applied],
                            "failed": [f.to_json() for f in applied.failed]})
    if applied.failed:
        raise typer.Exit(1)


@app.command()
def verify(spec: Spec, plan_path: Annotated[Path, typer.Argument(help="plan.json from `opswap plan`.")],
           budget: Annotated[str | None, typer.Option(help="e.g. 'cosine>=0.9999' (default: from the plan's exactness).")] = None,
           samples: Annotated[int, typer.Option(help="Random input samples.")] = 3,
           sets: SetOpt = None, dynamic: DynamicOpt = "auto",
           json_path: JsonOpt = None) -> None:
    """Compare the plan's result with the original; exit 1 when it breaks the tolerance."""
    from opswap.verify.layers import compare_layers
    from opswap.verify.outputs import verify as _verify
    from opswap.verify.tolerance import Tolerance, parse_budget

    _check_outputs(json_path)
    loaded, captured, p, applied = _applied(spec, plan_path, sets, dynamic)
    tol = Tolerance.for_exactness(p.settings.exactness).at_rounding(captured.rounding)
    if budget:
        tol = parse_budget(budget, base=tol)
    # against (a copy of) the model itself, at every shape the capture claims
    v = _verify(private_copy(loaded.module), applied.gm, captured.example_inputs,
                samples=samples, tolerance=tol, variants=captured.variants())
    data = v.to_json()
    table = Table(title="verification " + ("PASSED" if v.passed else "FAILED"))
    for col in ("max_abs", "max_rel", "cosine", "sqnr_db", "rel_l2"):
        table.add_column(col, justify="right")
    table.add_row(*(f"{data[c]:.3g}" if isinstance(data[c], float) else str(data[c])
                    for c in ("max_abs", "max_rel", "cosine", "sqnr_db", "rel_l2")))
    console.print(table)
    for r in getattr(v, "reasons", []):
        console.print(f"[red]{r}[/red]")
    if not v.passed:
        layers = compare_layers(captured, applied, captured.example_inputs)
        first = layers.first_divergence(tol)
        if first is not None:
            console.print(f"first divergence: {first}")
    _write_json(json_path, data)
    if not v.passed:
        raise typer.Exit(1)


@app.command()
def bench(spec: Spec, plan_path: Annotated[Path, typer.Argument(help="plan.json from `opswap plan`.")],
          device: Annotated[str, typer.Option(help=f"Where to time: {_DEVICES}.")] = "cpu",
          sets: SetOpt = None, dynamic: DynamicOpt = "auto",
          json_path: JsonOpt = None) -> None:
    """Time the original and the plan's result side by side (interleaved, after warm-up)."""
    from opswap.bench.timing import bench_models

    _check_outputs(json_path)
    _check_device(device)
    loaded, captured, p, applied = _applied(spec, plan_path, sets, dynamic)
    b = bench_models(private_copy(loaded.module), applied.gm, captured.example_inputs,
                     device=device)
    data = b.to_json()
    console.print(f"reference {data['ref_ms']:.3f} ms, optimized {data['opt_ms']:.3f} ms, "
                  f"speedup {data['speedup']:.2f}x on {data['device']}")
    _write_json(json_path, data)


@app.command()
def optimize(spec: Spec, target: TargetOpt = "cpu", rules: RulesOpt = None,
             exactness: ExactOpt = "exact",
             budget: Annotated[str | None, typer.Option(help="Accuracy budget, e.g. 'cosine>=0.9999'.")] = None,
             out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")] = Path("opswap-out"),
             samples: Annotated[int, typer.Option(help="Random input samples for verification.")] = 3,
             no_bench: Annotated[bool, typer.Option("--no-bench", help="Skip timing.")] = False,
             device: Annotated[str, typer.Option(help=f"Where to run and time: {_DEVICES}.")] = "cpu",
             dynamic: DynamicOpt = "auto",
             compare: Annotated[str, typer.Option("--compare", help="Baselines raced in the same run: compile (torch.compile of the input and of opswap's result), or none.")] = "compile",
             sets: SetOpt = None, json_path: JsonOpt = None) -> None:
    """The whole flow: analyze, plan, apply, verify (with rollback), bench, report."""
    from opswap.pipeline import OptimizeConfig
    from opswap.pipeline import optimize as _optimize

    _check_outputs(json_path, out, out_dir=True)
    _check_device(device)
    if samples < 1:
        raise OpswapError(f"--samples must be at least 1 (the example itself); got {samples}.")
    config = OptimizeConfig(target=target, rules=_rule_patterns(rules), exactness=exactness,
                            budget=budget, samples=samples, bench=not no_bench, device=device,
                            dynamic=dynamic, compare=compare)
    if not no_bench:
        from opswap.bench.variants import parse_compare

        parse_compare(compare)  # a typo fails now, not after the run
    stages = ["load", "capture", "analyze", "plan", "apply", "verify", "rollback", "bench",
              "measure", "prune", "layers", "race", "report"]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task("load", total=len(stages))

        def step(stage: str) -> None:
            done = stages.index(stage) if stage in stages else None
            progress.update(task, description=stage, completed=done)

        loaded = _load(spec, sets)
        result = _optimize(loaded.module, loaded.example_inputs, config, name=spec, progress=step)
        step("report")
        paths = result.save(out)
    data = result.to_json()
    _print_summary(data)
    for k in ("plan", "result", "report_md", "report_html", "model"):
        if k in paths:
            console.print(f"  {k:<11} {paths[k]}")
    _write_json(json_path, data)
    if not data["verification"]["passed"]:
        raise typer.Exit(1)


def _print_summary(data: dict) -> None:
    v, b = data["verification"], data["benchmark"]
    console.print(f"[bold]{data['model']}[/bold] on {data['target']}: "
                  f"{len(data['applied'])} replacements, {len(data['misses'])} near misses, "
                  f"{len(data['rolled_back'])} rolled back")
    dyn = data.get("dynamic") or {}
    axes = ", ".join(f"{a['name']} (example {a['size']})" for a in dyn.get("axes", []))
    console.print(f"  dynamic sizes: {axes or 'none (the example shapes only)'}", markup=False)
    status = "[green]PASSED[/green]" if v["passed"] else "[red]FAILED[/red]"
    console.print(f"  verification {status}: cosine {v['cosine']:.8f}, max_abs {v['max_abs']:.3g}, "
                  f"sqnr {v['sqnr_db']:.1f} dB")
    if b:
        console.print(f"  eager: {b['ref_ms']:.3f} ms -> {b['opt_ms']:.3f} ms, "
                      f"{b['ref_ms'] / b['opt_ms']:.2f}x, ratio of medians ({b['device']})",
                      markup=False)
    if data.get("variants"):
        _print_variants(data)


def _print_variants(data: dict) -> None:
    table = Table(title="variants, timed in one interleaved run")
    for col in ("variant", "ms", "IQR ms", "vs input", "per-round quartiles", "verified",
                "compile s", "note"):
        table.add_column(col, overflow="fold")
    for v in data["variants"]:
        ms = f"{v['ms']:.3f}" if v["ms"] is not None else "-"
        iqr = f"{v['iqr_ms']:.3f}" if v["iqr_ms"] is not None else "-"
        sp = f"{v['speedup_vs_input']:.2f}x" if v["speedup_vs_input"] is not None else "-"
        q = v["speedup_quartiles"]
        qs = f"{q[0]:.2f}-{q[1]:.2f}" if q[0] is not None else "-"
        comp = f"{v['compile_s']:.1f}" if v["compile_s"] is not None else ""
        name = v["name"] + (" (saved)" if v["name"] == data["best"] else "")
        table.add_row(Text(name), ms, iqr, sp, qs, "yes" if v["verified"] else "no", comp,
                      Text(v["note"] or ""))
    console.print(table)
    console.print(Text(f"  saved: {data['deploy']['holds']} ({data['deploy']['how']})"))


def _click_errors() -> tuple[type[Exception], ...]:
    """ClickException of the click copy newer typer vendors and of the click package that
    older typer runs on; either may be absent."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(importlib.import_module(module).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def main(argv: list[str] | None = None) -> None:
    try:
        rc = app(args=argv, standalone_mode=False)
    except OpswapError as e:
        # Text, not markup: a message holding "[torch.float16]" must print as written
        err.print(Text.assemble(("error:", "bold red"), " ", str(e)), soft_wrap=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except _click_errors() as e:  # usage errors: click's message, exit status 2
        e.show()
        sys.exit(e.exit_code)
    if isinstance(rc, int) and rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
