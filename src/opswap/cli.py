"""The `opswap` command: parses arguments, calls the Python API, prints.

Every command has --help; commands that produce data take --json PATH.
Errors opswap raises on purpose print as one line and exit with status 2; the
exit statuses are in EXIT_STATUS (shown by `opswap --help`).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.padding import Padding
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from opswap.errors import OpswapError
from opswap.graph.copies import private_copy

EXIT_STATUS = (
    "Exit status, the same for every command: 0 when everything asked for was done and "
    "passed; 1 when a verification failed or decisions of a plan could not be applied "
    "(the command says what it saved and why); 2 for usage errors and for errors opswap "
    "names in one line (a bad spec, target, path, plan or weights file); 130 when "
    "interrupted."
)


class _FlagsAsFlags:
    """Help that shows a flag as a flag: typer >= 0.24 prints a type for every option,
    so `--no-bench` and `--help` read as if they took a value (`<bool>`)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
                p.metavar = ""
        return params


class _Command(_FlagsAsFlags, typer.core.TyperCommand):
    pass


class _Group(_FlagsAsFlags, typer.core.TyperGroup):
    pass


class _App(typer.Typer):
    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    name="opswap",
    help="Operator replacement for PyTorch models: find the costly ops, swap them, "
    "prove the numbers match, measure the gain.",
    epilog=EXIT_STATUS,
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# piped output (CI logs, files) gets a wide fixed width instead of rich's 80 columns,
# unless COLUMNS says otherwise
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)
err = Console(stderr=True)

Spec = Annotated[str, typer.Argument(metavar="SPEC", help="Model: zoo:NAME, hf:TYPE, hf:PATH, torchvision:NAME, "
                                          "timm:NAME, file.py:function or model.pt2.")]
PlanArg = Annotated[Path, typer.Argument(metavar="PLAN", help="plan.json from `opswap plan`.")]
TargetOpt = Annotated[str, typer.Option("--target", "-t", metavar="TARGET", help="Hardware target (cpu, h100, h200, a100).")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help="Model override (repeatable).")]
WeightsOpt = Annotated[Path | None, typer.Option("--weights", "-w", metavar="FILE", help="Weights for the spec's architecture: a .safetensors file or a torch.save state dict (read with weights_only=True).")]
JsonOpt = Annotated[Path | None, typer.Option("--json", metavar="PATH", help="Also write machine-readable output here.")]
RulesOpt = Annotated[str | None, typer.Option("--rules", "-r", metavar="GLOBS", help="Comma-separated rule globs, e.g. 'fusion.*,layout.drop_*'.")]
ExactOpt = Annotated[str, typer.Option("--exactness", "-e", metavar="CLASS", help="Loosest rules allowed: exact, approx or lossy.")]
RulesFromOpt = Annotated[list[str] | None, typer.Option("--rules-from", metavar="MODULE", help="Also load the rules @register'ed in this Python module (a name found on the Python path or in the current directory, or a .py file; repeatable). Installed packages add theirs through the opswap.rules entry-point group.")]
DynamicOpt = Annotated[str, typer.Option("--dynamic", metavar="SIZES", help="Input sizes kept symbolic: auto (batch and sequence, detected), none, batch, seq, or I:D=NAME items.")]
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


def _load(spec: str, sets: list[str] | None, weights: Path | None = None):
    from opswap.models import load

    loaded = load(spec, _overrides(sets), weights=weights)
    if loaded.settings.get("mode", "").startswith("eval:"):
        console.print(Text(f"note: {spec} was put in eval mode ({loaded.settings['mode'][6:]}); "
                           "opswap.optimize on a module keeps the mode it is given."))
    record = loaded.settings.get("weights")
    if record:
        console.print(Text(_weights_line(record)))
    return loaded


def _weights_line(record: dict) -> str:
    keys = f", keys read with {record['keys']}" if record["keys"] != "as saved" else ""
    return (f"weights: {record['file']} ({_n(record['tensors'], 'tensor')}{keys}, "
            f"stored as {', '.join(record['file_dtypes'])})")


def _n(count: int, singular: str, plural: str | None = None) -> str:
    """'1 replacement', '3 replacements'."""
    return f"{count} {singular if count == 1 else plural or singular + 's'}"


def _write_json(path: Path | None, data) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    console.print(Text(f"wrote {path}", style="dim"))


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


def _note(text: str, label: str = "note", style: str = "yellow") -> None:
    """One line `label: text`, the text printed as written (no rich markup)."""
    console.print(Text.assemble((f"{label}:", style), " ", str(text)), soft_wrap=True)


def _rules_from(modules: list[str] | None) -> None:
    """Load the rules of the modules named by --rules-from, and say which installed plugins
    were left out (the built-in rules work without them)."""
    from opswap.rules import registry

    for module in modules or []:
        registry.load_module(module)
    for problem in registry.problems():
        _note(problem, "plugin")


def _rule_patterns(rules: str | None) -> list[str]:
    return [p.strip() for p in rules.split(",") if p.strip()] if rules else []


@app.command()
def analyze(spec: Spec, target: TargetOpt = "cpu", sets: SetOpt = None, json_path: JsonOpt = None,
            dynamic: DynamicOpt = "auto", weights: WeightsOpt = None,
            top: Annotated[int, typer.Option(metavar="N", help="Rows to show (all are in --json).")] = 40) -> None:
    """Per-op FLOPs, bytes, intensity and bound against a target; totals and bottlenecks."""
    from opswap.api import capture
    from opswap.cost.analyze import analyze as _analyze
    from opswap.cost.analyze import render
    from opswap.report.advice import advised
    from opswap.targets import get_target

    _check_outputs(json_path)
    tgt = get_target(target)
    loaded = _load(spec, sets, weights)
    captured = capture(loaded.module, loaded.example_inputs, dynamic=dynamic)
    for note in captured.notes:
        _note(note)
    result = advised(_analyze(captured, tgt, model_name=spec))
    render(result, console, top=top)
    _write_json(json_path, result.to_json())


@app.command("rules")
def list_rules(json_path: JsonOpt = None, rules_from: RulesFromOpt = None,
               wide: Annotated[bool, typer.Option("--wide", help="Print every rule's whole description, wrapped to the terminal's width, instead of the table's first sentence.")] = False) -> None:
    """Every rule: name, family, chapter, exactness, targets, what it does, and where it came
    from when not from opswap itself (--rules-from, an installed package)."""
    from opswap.rules.registry import all_rules, origin

    _check_outputs(json_path)
    _rules_from(rules_from)
    rows = [{**r.info(), "origin": origin(r.name)} for r in all_rules()]
    if wide:
        for r in rows:
            where = f", from {r['origin']}" if r["origin"] != "opswap" else ""
            console.print(Text.assemble((r["name"], "bold"), f"  ({r['family']}, ch. {r['chapter']}, "
                                        f"{r['exactness']}, targets {','.join(r['targets'])}{where})"))
            console.print(Padding(Text(" ".join(r["description"].split())), (0, 0, 1, 4)))
        _write_json(json_path, rows)
        return
    table = Table(title=_n(len(rows), "rule"))
    # on a narrow terminal the family (the name's first part) gives its room to the text
    cols = ("name", "family", "ch.", "exactness", "targets", "what it does")
    if console.width < 120:
        cols = tuple(c for c in cols if c != "family")
    if any(r["origin"] != "opswap" for r in rows):
        cols += ("from",)
    for col in cols:
        table.add_column(col, overflow="fold", no_wrap=col == "name")
    cut = False
    for r in rows:
        first = _first_sentence(r["description"])
        cut |= first != " ".join(r["description"].split())
        cells = {"name": Text(r["name"]), "family": r["family"], "ch.": str(r["chapter"]),
                 "exactness": r["exactness"], "targets": ",".join(r["targets"]),
                 "what it does": Text(first), "from": Text(r["origin"])}
        table.add_row(*(cells[c] for c in cols))
    console.print(table)
    if cut:
        console.print("descriptions stop at their first sentence; `opswap rules --wide` prints "
                      "them whole", style="dim", markup=False)
    _write_json(json_path, rows)


def _first_sentence(text: str) -> str:
    words = " ".join(text.split())
    m = re.search(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.\s(?=[A-Z(])", words)
    return words[:m.start() + 1] + " ..." if m else words


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
    from opswap.models.hf import hf_kinds

    kinds = hf_kinds()
    hf = Table(title="hf: (Hugging Face types checked end to end; small configs, random weights)")
    hf.add_column("kind")
    hf.add_column("specs", overflow="fold")
    for kind in ("encoder", "decoder", "encoder-decoder", "vision", "vision-text"):
        names = [t for t, k in kinds.items() if k == kind]
        if names:
            hf.add_row(kind, ", ".join(f"hf:{t}" for t in names))
    console.print(hf)
    console.print("Any other type transformers knows is tried the same way; --set size=full "
                  "builds its default sizes, --set mask=none drops the padded attention mask.")
    _write_json(json_path, {"zoo": [{"name": z.name, "description": z.description,
                                      "chapters": list(z.chapters)} for z in zoo],
                             "hf": list(list_hf_types()), "hf_kinds": kinds})


def _print_plan(plan) -> None:
    table = Table(title="plan: " + _n(len(plan.decisions), "replacement"))
    for col in ("#", "rule", "module", "site", "what", "pred. bytes saved", "pred. FLOPs saved"):
        table.add_column(col, overflow="fold")
    from opswap.cost.units import human, human_unit

    # cells are Text: a site or a reason may hold square brackets, which markup would eat
    for i, d in enumerate(plan.decisions):
        table.add_row(str(i), Text(d.rule), Text(d.module or "-"), Text(d.site.key),
                      Text(d.site.description),
                      human_unit(d.estimate.bytes_saved, "B"), human(d.estimate.flops_saved))
    console.print(table)
    if plan.misses:
        mt = Table(title=_n(len(plan.misses), "near miss", "near misses"))
        for col in ("rule", "where", "why not"):
            mt.add_column(col, overflow="fold")
        for m in plan.misses:
            mt.add_row(Text(m.rule), Text(m.where), Text(m.reason))
        console.print(mt)
    for f in plan.failed:
        _note(f"{f.rule} at {f.where}: {f.reason}", "failed", "red")
    for s in plan.skipped:
        _note(f"{s.rule} at {s.where}: {s.reason}", "skipped")


@app.command()
def plan(spec: Spec, target: TargetOpt = "cpu", rules: RulesOpt = None,
         exactness: ExactOpt = "exact", sets: SetOpt = None, dynamic: DynamicOpt = "auto",
         out: Annotated[Path, typer.Option("--out", "-o", metavar="FILE", help="Where to write the plan.")] = Path("plan.json"),
         weights: WeightsOpt = None, rules_from: RulesFromOpt = None,
         json_path: JsonOpt = None) -> None:
    """Match the rules on a model and write plan.json (sites chosen, misses, settings)."""
    from opswap.api import capture
    from opswap.bench.timing import with_timer
    from opswap.planner import make_plan
    from opswap.targets import get_target

    _check_outputs(json_path, out)
    _rules_from(rules_from)
    loaded = _load(spec, sets, weights)
    captured = capture(loaded.module, loaded.example_inputs, dynamic=dynamic)
    p = make_plan(captured, target=with_timer(get_target(target)), rules=_rule_patterns(rules),
                  exactness=exactness, model_name=spec)
    _print_plan(p)
    p.save(out)
    console.print(Text(f"wrote {out}"))
    _write_json(json_path, p.to_json())


def _applied(spec: str, plan_path: Path, sets, dynamic: str = "auto", weights: Path | None = None,
             allow_looser: bool = True):
    from opswap.api import capture
    from opswap.planner import Plan, apply_plan, check_exactness
    from opswap.rules import registry

    p = Plan.load(plan_path)
    if not allow_looser:  # before the model loads: a refusal costs nothing
        check_exactness(p, [registry.get(d.rule) for d in p.decisions])
    loaded = _load(spec, sets, weights)
    captured = capture(loaded.module, loaded.example_inputs, dynamic=dynamic)
    # verify and bench judge and time what the plan holds (verify at the plan's own
    # exactness); only apply, which saves the result, refuses looser decisions
    applied = apply_plan(captured, p, allow_looser=allow_looser)
    for f in applied.failed:
        _note(f"{f.rule} at {f.where}: {f.reason}", "not applied", "red")
    return loaded, captured, p, applied


def _partial(p, applied, done: str) -> None:
    """The line that goes with exit status 1 when part of a plan did not apply; `done` says
    what the command did with the rest ('{n}' stands for their number)."""
    if applied.failed:
        rest = done.format(n=len(applied.applied))
        _note(f"{len(applied.failed)} of {_n(len(p.decisions), 'decision')} could not be "
              f"applied (listed above); {rest}; exit status 1.", "partial plan", "red")


def _print_inputs(module) -> None:
    """Say which positional order a model given keyword inputs is captured in."""
    from opswap.graph.keywords import KeywordCall

    if isinstance(module, KeywordCall):
        _note("the model takes keyword inputs; the optimized model " + module.describe(),
              "inputs", "cyan")


@app.command()
def apply(spec: Spec, plan_path: PlanArg,
          sets: SetOpt = None, dynamic: DynamicOpt = "auto", weights: WeightsOpt = None,
          out: Annotated[Path | None, typer.Option("--out", "-o", metavar="DIR", help="Save the optimized model in this directory.")] = None,
          rules_from: RulesFromOpt = None,
          allow_looser: Annotated[bool, typer.Option("--allow-looser", help="Apply decisions whose rule is looser than the plan's exactness (an approx rule in an exact plan); refused otherwise.")] = False,
          json_path: JsonOpt = None) -> None:
    """Re-apply a plan to a model; optionally save the optimized model. Exit status 1 when
    decisions of the plan could not be applied (the model is saved without them); 2 when a
    decision's rule is looser than the plan's exactness and --allow-looser is not given."""
    from opswap.artifact import save_model

    _check_outputs(json_path, out, out_dir=True)
    _rules_from(rules_from)
    loaded, captured, p, applied = _applied(spec, plan_path, sets, dynamic, weights,
                                            allow_looser=allow_looser)
    console.print(f"applied {len(applied.applied)} of {_n(len(p.decisions), 'decision')}")
    _print_inputs(loaded.module)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        files = save_model(applied.gm, captured.example_inputs, out, dynamic=captured.dynamic)
        console.print(Text(f"saved {files['model']}"))
    _partial(p, applied, f"saved {files['model']} with the {{n}} that did" if out is not None
             else "nothing was saved (no --out)")
    _write_json(json_path, {"applied": [s.to_json() for s in applied.applied],
                            "failed": [f.to_json() for f in applied.failed]})
    if applied.failed:
        raise typer.Exit(1)


@app.command()
def verify(spec: Spec, plan_path: PlanArg,
           budget: Annotated[str | None, typer.Option(metavar="METRIC>=X", help="e.g. 'cosine>=0.9999' (default: from the plan's exactness).")] = None,
           samples: Annotated[int, typer.Option(metavar="N", help="Random input samples.")] = 3,
           sets: SetOpt = None, dynamic: DynamicOpt = "auto", weights: WeightsOpt = None,
           rules_from: RulesFromOpt = None, json_path: JsonOpt = None) -> None:
    """Compare the plan's result with the original; exit 1 when it breaks the tolerance or
    decisions of the plan could not be applied."""
    from opswap.verify.layers import compare_layers
    from opswap.verify.outputs import verify as _verify
    from opswap.verify.tolerance import Tolerance, parse_budget

    _check_outputs(json_path)
    _rules_from(rules_from)
    loaded, captured, p, applied = _applied(spec, plan_path, sets, dynamic, weights)
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
    source = f"budget {budget} over the" if budget else "the"
    console.print(Text(f"tolerance: {_tolerance_text(data['tolerance'])} ({source} "
                       f"{p.settings.exactness} defaults); {_samples_text(v, samples)}"))
    for r in getattr(v, "reasons", []):
        console.print(Text(str(r), style="red"))
    if not v.passed:
        layers = compare_layers(captured, applied, captured.example_inputs)
        first = layers.first_divergence(tol)
        if first is not None:
            console.print(Text(f"first divergence: {first}"))
    _print_inputs(loaded.module)
    _partial(p, applied, "verified the model with the {n} that did")
    _write_json(json_path, data)
    if not v.passed or applied.failed:
        raise typer.Exit(1)


def _samples_text(v, asked: int) -> str:
    """'5 samples: 3 at the example shape 2x3x32x32, one at each of batch 1, batch 3'."""
    first, others = (v.shapes[0], v.shapes[1:]) if v.shapes else ("example shape", [])
    text = f"{_n(v.samples, 'sample')}: {asked} at the {first}"
    return text + (f", one at each of {', '.join(others)}" if others else "")


def _tolerance_text(tol: dict) -> str:
    """'cosine>=0.99999, rel_l2<=1e-05, sqnr_db>=100' from Tolerance.to_json(), every
    threshold as set (0.9999999999 stays that, not a rounded 1)."""
    from opswap.report.optimize_report import tolerance_text

    return tolerance_text(tol)


@app.command()
def bench(spec: Spec, plan_path: PlanArg,
          device: Annotated[str, typer.Option(metavar="DEVICE", help=f"Where to time: {_DEVICES}.")] = "cpu",
          sets: SetOpt = None, dynamic: DynamicOpt = "auto", weights: WeightsOpt = None,
          rules_from: RulesFromOpt = None, json_path: JsonOpt = None) -> None:
    """Time the original and the plan's result side by side (interleaved, after warm-up).
    Exit status 1 when decisions of the plan could not be applied (the rest is timed)."""
    from opswap.bench.timing import bench_models
    from opswap.planner import Plan

    _check_outputs(json_path)
    _check_device(device)
    _rules_from(rules_from)
    _where_timed(Plan.load(plan_path).settings.target, device)
    loaded, captured, p, applied = _applied(spec, plan_path, sets, dynamic, weights)
    b = bench_models(private_copy(loaded.module), applied.gm, captured.example_inputs,
                     device=device)
    data = b.to_json()
    from opswap.report.optimize_report import interval

    console.print(Text(
        f"reference {data['ref_ms']:.3f} ms (IQR {data['ref_iqr_ms']:.3f}), optimized "
        f"{data['opt_ms']:.3f} ms (IQR {data['opt_iqr_ms']:.3f}), speedup "
        f"{interval(data['speedup_of_medians'], data['speedup_ci'], data['settled'])} "
        f"(ratio of the medians, 95% interval; IQR of the per-round ratios "
        f"{data['spread']:.2f}), {_n(data['rounds'], 'interleaved round')} on "
        f"{data['device']}"))
    if data["settled"] is False:
        _unsettled(race=False)
    _partial(p, applied, "timed the model with the {n} that did")
    _write_json(json_path, data)
    if applied.failed:
        raise typer.Exit(1)


def _where_timed(target: str, device: str) -> None:
    """One line when the plan's target is not the device the times are measured on."""
    from opswap.bench.timing import describe_device
    from opswap.targets import get_target

    tgt = get_target(target)
    here = describe_device(device)
    dev = device.split(":")[0]
    name = tgt.name.lower()
    same = (tgt.kind == "cpu" and dev == "cpu") or (
        tgt.kind == dev and re.search(rf"\b{re.escape(name)}\b", here.lower()) is not None)
    if not same:
        _note(f"the plan is made for {tgt.name} ({tgt.description}), but times are measured "
              f"here, on {here}.", "timing")


@app.command()
def optimize(spec: Spec, target: TargetOpt = "cpu", rules: RulesOpt = None,
             exactness: ExactOpt = "exact",
             budget: Annotated[str | None, typer.Option(metavar="METRIC>=X", help="Accuracy budget, e.g. 'cosine>=0.9999'.")] = None,
             out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="Output directory.")] = Path("opswap-out"),
             samples: Annotated[int, typer.Option(metavar="N", help="Random input samples for verification.")] = 3,
             no_bench: Annotated[bool, typer.Option("--no-bench", help="Skip timing.")] = False,
             device: Annotated[str, typer.Option(metavar="DEVICE", help=f"Where to run and time: {_DEVICES}.")] = "cpu",
             dynamic: DynamicOpt = "auto",
             compare: Annotated[str, typer.Option("--compare", metavar="BASELINES", help="Baselines raced in the same run: compile (torch.compile of the input and of opswap's result), or none.")] = "compile",
             sets: SetOpt = None, weights: WeightsOpt = None, rules_from: RulesFromOpt = None,
             json_path: JsonOpt = None) -> None:
    """The whole flow: analyze, plan, apply, verify (with rollback), bench, report. Exit
    status 1 when the result fails verification (what was saved is printed)."""
    from opswap.pipeline import OptimizeConfig
    from opswap.pipeline import optimize as _optimize

    _check_outputs(json_path, out, out_dir=True)
    _check_device(device)
    _rules_from(rules_from)
    if samples < 1:
        raise OpswapError(f"--samples must be at least 1 (the example itself); got {samples}.")
    config = OptimizeConfig(target=target, rules=_rule_patterns(rules), exactness=exactness,
                            budget=budget, samples=samples, bench=not no_bench, device=device,
                            dynamic=dynamic, compare=compare)
    if not no_bench:
        from opswap.bench.variants import parse_compare

        parse_compare(compare)  # a typo fails now, not after the run
        _where_timed(target, device)
    stages = ["load", "capture", "analyze", "plan", "apply", "verify", "rollback", "bench",
              "measure", "prune", "layers", "race", "report"]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task("load", total=len(stages))

        def step(stage: str) -> None:
            done = stages.index(stage) if stage in stages else None
            progress.update(task, description=stage, completed=done)

        loaded = _load(spec, sets, weights)
        result = _optimize(loaded.module, loaded.example_inputs, config, name=spec, progress=step,
                           model_settings=loaded.settings)
        from opswap.api import note_inputs

        note_inputs(result, loaded.module)
        if loaded.settings.get("weights"):
            result.notes.insert(0, _weights_line(loaded.settings["weights"]).capitalize() + ".")
        step("report")
        paths = result.save(out)
    data = result.to_json()
    _print_summary(data)
    for k in ("plan", "result", "report_md", "report_html", "model"):
        if k in paths:
            console.print(Text(f"  {k:<11} {paths[k]}"))
    _print_inputs(loaded.module)
    _write_json(json_path, data)
    if not data["verification"]["passed"]:
        _note(f"opswap's result did not pass verification ({'; '.join(data['verification']['reasons'])}); "
              f"{paths.get('model', out)} holds {data['deploy']['holds']}; exit status 1.",
              "failed", "red")
        raise typer.Exit(1)


def _unsettled(race: bool = True) -> None:
    """The warning for timings whose intervals stayed wide (a busy machine)."""
    from opswap.report.optimize_report import unsettled_warning

    _note(unsettled_warning(race).replace("**", ""), "warning", "red")


def _print_summary(data: dict) -> None:
    v, b = data["verification"], data["benchmark"]
    console.print(Text.assemble((data["model"], "bold"), f" on {data['target']}: "
                                f"{_n(len(data['applied']), 'replacement')}, "
                                f"{_n(len(data['misses']), 'near miss', 'near misses')}, "
                                f"{len(data['rolled_back'])} rolled back"))
    dyn = data.get("dynamic") or {}
    axes = ", ".join(f"{a['name']} (example {a['size']})" for a in dyn.get("axes", []))
    console.print(f"  dynamic sizes: {axes or 'none (the example shapes only)'}", markup=False)
    status = ("PASSED", "green") if v["passed"] else ("FAILED", "red")
    console.print(Text.assemble("  verification ", status,
                                f": cosine {v['cosine']:.8f}, max_abs {v['max_abs']:.3g}, "
                                f"sqnr {v['sqnr_db']:.1f} dB ({_n(v['samples'], 'sample')}, "
                                f"tolerance {_tolerance_text(v['tolerance'])})"))
    if b:
        from opswap.report.optimize_report import interval

        console.print(f"  your model -> opswap's model.pt2: {b['ref_ms']:.3f} ms -> "
                      f"{b['opt_ms']:.3f} ms, "
                      f"{interval(b['speedup_of_medians'], b.get('speedup_ci'), b.get('settled'))} "
                      f"(ratio of medians, 95% interval; {b['device']})", markup=False)
    run = data.get("run") or {}
    if run.get("inputs"):
        shapes = ", ".join(f"{i['name']} {i['dtype']}{list(i['shape'])}" for i in run["inputs"])
        console.print(f"  inputs: {shapes}; {run.get('threads')} threads", markup=False)
    for note in data.get("notes") or []:
        console.print(f"  note: {note}", markup=False)
    if data.get("variants"):
        _print_variants(data)


def _print_variants(data: dict) -> None:
    from opswap.report.optimize_report import interval

    table = Table(title="variants, timed in one interleaved run")
    for col in ("variant", "ms", "IQR ms", "vs input [95% interval]", "verified", "compile s",
                "note"):
        table.add_column(col, overflow="fold")
    for v in data["variants"]:
        ms = f"{v['ms']:.3f}" if v["ms"] is not None else "-"
        iqr = f"{v['iqr_ms']:.3f}" if v["iqr_ms"] is not None else "-"
        sp = ("1.00x (the yardstick)" if v["name"] == "input" else
              interval(v["speedup_vs_input"], v.get("speedup_ci"), v.get("settled"))
              if v["speedup_vs_input"] is not None else "-")
        comp = f"{v['compile_s']:.1f}" if v["compile_s"] is not None else ""
        name = v["name"] + (" (saved)" if v["name"] == data["best"] else "")
        table.add_row(Text(name), ms, iqr, Text(sp), "yes" if v["verified"] else "no", comp,
                      Text(v["note"] or ""))
    console.print(table)
    if data.get("timings_settled") is False:
        _unsettled()
    deploy = data["deploy"]
    console.print(Text(f"  saved: {deploy['variant']}, {deploy['holds']}"))
    if deploy.get("verified_as"):
        shapes = deploy["verified_as"].get("shapes") or []
        console.print(Text(f"  verified as: {deploy['verified_as']['variant']}"
                           + (f", at {', '.join(shapes)}" if shapes else "")))
    use = "use" if deploy["how"].startswith("your own") else "load it with"
    console.print(Text(f"  {use} {deploy['how']}; run it under {deploy['run_under']}"))


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
