"""The commands: each checks its arguments, calls one function of opswap.api and prints
what it returns (opswap.cli.render). A spec is loaded through `_load` here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opswap import api
from opswap.cli import consoles, onnx_files, render
from opswap.cli.app import app, check_outputs, overrides
from opswap.cli.options import (
    _DEVICES,
    BackendOpt,
    CalibrationOpt,
    DynamicOpt,
    ExactOpt,
    JsonOpt,
    PlanArg,
    RulesFromOpt,
    RulesOpt,
    SetOpt,
    Spec,
    TargetOpt,
    WeightsOpt,
)


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


def _calibration_file(path: Path | None) -> str | None:
    """The --calibration file, checked before any model is loaded."""
    from opswap.graph.calibration_data import check_path

    return str(check_path(path)) if path is not None else None


def _calibrated(said: str | None, judged_on: str = "") -> None:
    if said:
        render.note(said, "calibration")
    if judged_on:
        render.note(f"verified on {judged_on}", "verification")


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
    if onnx_files.is_onnx(spec):
        return onnx_files.analyze(spec, overrides(sets), json_path, top)
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
    calibration: CalibrationOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Match the rules on a model and write plan.json (sites chosen, misses, settings).
    Static int8 is planned at --exactness approx when there is calibration data: the
    --calibration file, else the spec file's calibration(); the plan keeps its scales."""
    check_outputs(json_path, out)
    if onnx_files.is_onnx(spec):
        return onnx_files.plan(spec, overrides(sets), rules, exactness, out, json_path)
    _rules_from(rules_from)
    data = _calibration_file(calibration)
    loaded = _load(spec, sets, weights)
    p = api.plan(
        loaded.module,
        loaded.example_inputs,
        target=target,
        rules=rules,
        exactness=exactness,
        dynamic=dynamic,
        name=spec,
        calibration_data=data if data is not None else loaded.calibration,
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
    calibration: CalibrationOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Re-apply a plan to a model; optionally save the optimized model. Static int8
    decisions take the scales the plan holds (for the weights it was made with), or
    calibrate on --calibration FILE. Exit status 1 when decisions of the plan could not be
    applied (the model is saved without them); 2 when a decision's rule is looser than
    the plan's exactness and --allow-looser is not given, or the plan's int8 decisions
    have no calibration."""
    check_outputs(json_path, out, out_dir=True)
    onnx_files.refuse(spec, "apply")
    _rules_from(rules_from)
    data = _calibration_file(calibration)
    p = api.read_plan(plan_path, allow_looser=allow_looser)  # a refusal costs no loading
    loaded = _load(spec, sets, weights)
    done = api.replay(
        loaded.module,
        loaded.example_inputs,
        p,
        dynamic=dynamic,
        allow_looser=allow_looser,
        out=out,
        calibration_data=data,
        calibration_fallback=api.spec_calibration(loaded),
    )
    _calibrated(done.calibration)
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
    backend: BackendOpt = "pytorch",
    layers: Annotated[
        bool,
        typer.Option(
            "--layers",
            help="Also compare the result layer by layer: with --backend ort or openvino, "
            "every value the runtime computes with PyTorch running the same exported graph "
            "(done on its own when verification fails); in PyTorch, every value of the "
            "plan's graph with the same node of the model's capture.",
        ),
    ] = False,
    calibration: CalibrationOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Compare the plan's result with the original (in PyTorch, or with --backend as the
    file that runtime runs); exit 1 when it breaks the tolerance or decisions of the plan
    could not be applied."""
    check_outputs(json_path)
    _rules_from(rules_from)
    onnx_files.refuse(spec, "verify")
    data = _calibration_file(calibration)
    p = api.read_plan(plan_path)
    loaded = _load(spec, sets, weights)
    check = api.verify_plan(
        loaded.module,
        loaded.example_inputs,
        p,
        budget=budget,
        samples=samples,
        dynamic=dynamic,
        backend=backend,
        layers=layers,
        calibration_data=data,
        calibration_fallback=api.spec_calibration(loaded),
    )
    _calibrated(check.replay.calibration, check.replay.data_said)
    render.not_applied(check.replay.applied)
    render.verification(check, budget, samples)
    render.runtime_layers(check, backend)
    render.inputs(loaded.module)
    render.partial(p, check.replay.applied, "verified the model with the {n} that did")
    report = check.verification.to_json()
    if check.runtime_layers is not None:
        report["runtime_layers"] = render.runtime_layers_json(check)
    render.write_json(json_path, report)
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
    backend: BackendOpt = "pytorch",
    calibration: CalibrationOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Time the original and the plan's result side by side (interleaved, after warm-up),
    in PyTorch or, with --backend, both exported and run in that runtime on the CPU.
    Exit status 1 when decisions of the plan could not be applied (the rest is timed)."""
    check_outputs(json_path)
    api.check_device(device)
    _rules_from(rules_from)
    onnx_files.refuse(spec, "bench")
    data = _calibration_file(calibration)
    p = api.read_plan(plan_path)
    _timed_where(p.settings.target, device)
    loaded = _load(spec, sets, weights)
    timed = api.bench_plan(
        loaded.module,
        loaded.example_inputs,
        p,
        device=device,
        dynamic=dynamic,
        backend=backend,
        calibration_data=data,
        calibration_fallback=api.spec_calibration(loaded),
    )
    _calibrated(timed.replay.calibration)
    render.not_applied(timed.replay.applied)
    data = timed.benchmark.to_json()
    render.bench(data)
    render.partial(p, timed.replay.applied, "timed the model with the {n} that did")
    render.write_json(json_path, data)
    if timed.replay.applied.failed:
        raise typer.Exit(1)


@app.command("export")
def export_cmd(
    spec: Spec,
    plan_path: PlanArg,
    to: Annotated[
        str,
        typer.Option(
            "--to",
            metavar="FORMAT",
            help="onnx or ort (the same .onnx file, for ONNX Runtime), openvino (model.xml + "
            "model.bin, OpenVINO's IR in float32), or executorch / pte (model.pte, an "
            "ExecuTorch program with the XNNPACK delegate). Static int8 layers take the form "
            "that runtime runs fastest: MatMulInteger for ort, QuantizeLinear/"
            "DequantizeLinear pairs for openvino and for a plain onnx file; in Python, opswap.backends.onnx.export_onnx("
            "..., int8=) takes the same names (its earlier values integer and qdq still work).",
        ),
    ] = "onnx",
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", metavar="DIR", help="Where to write model.onnx, model.xml or model.pte."
        ),
    ] = Path("opswap-export"),
    samples: Annotated[int, typer.Option(metavar="N", help="Random input samples.")] = 3,
    sets: SetOpt = None,
    dynamic: DynamicOpt = "auto",
    weights: WeightsOpt = None,
    rules_from: RulesFromOpt = None,
    calibration: CalibrationOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Export the plan's result to DIR/model.onnx (DIR/model.xml with --to openvino,
    DIR/model.pte with --to executorch), dynamic in the sizes the capture claims, and
    verify it in its runtime against the original. Static int8 decisions take the scales
    the plan holds, or calibrate on --calibration FILE, and are written as int8 operators.
    Exit 1 when it breaks the tolerance or decisions of the plan could not be applied."""
    check_outputs(json_path, out, out_dir=True)
    api.check_export(to)  # a format or a runtime missing fails before any work
    _rules_from(rules_from)
    onnx_files.refuse(spec, "export")
    data = _calibration_file(calibration)
    p = api.read_plan(plan_path)
    loaded = _load(spec, sets, weights)
    done = api.export(
        loaded.module,
        loaded.example_inputs,
        p,
        to=to,
        out=out,
        samples=samples,
        dynamic=dynamic,
        calibration_data=data,
        calibration_fallback=api.spec_calibration(loaded),
    )
    _calibrated(done.replay.calibration, done.replay.data_said)
    render.not_applied(done.replay.applied)
    render.verification(done, None, samples)
    if done.note:
        render.note(done.note, "shapes")
    render.line(f"wrote {done.path}")
    if done.path.suffix == ".xml":  # verified in float32: a bf16-capable CPU runs bf16 unless told
        render.line(
            f'load it as verified: openvino.Core().compile_model("{done.path}", "CPU", '
            '{"INFERENCE_PRECISION_HINT": "f32"}), or opswap.load_optimized('
            f'"{done.path.parent}"); without the hint a CPU with bf16 runs it in bf16 and '
            "its numbers change"
        )
    render.partial(p, done.replay.applied, "exported the model with the {n} that did")
    render.write_json(
        json_path, {"model": str(done.path), "verification": done.verification.to_json()}
    )
    if not done.verification.passed or done.replay.applied.failed:
        raise typer.Exit(1)


@app.command("debug-precision")
def debug_precision(
    spec: Spec,
    rules: RulesOpt = None,
    budget: Annotated[
        str | None,
        typer.Option(
            metavar="METRIC>=X",
            help="Tolerance the kept sites must meet, e.g. 'rel_l2<=0.01' (default: the rules' exactness).",
        ),
    ] = None,
    target: TargetOpt = "cpu",
    samples: Annotated[int, typer.Option(metavar="N", help="Random input samples.")] = 3,
    out: Annotated[
        Path, typer.Option("--out", "-o", metavar="DIR", help="Output directory.")
    ] = Path("opswap-precision"),
    sets: SetOpt = None,
    dynamic: DynamicOpt = "auto",
    weights: WeightsOpt = None,
    rules_from: RulesFromOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Which layers must stay in float32 for a low-precision scheme (default precision.bf16)
    to meet a tolerance: each site measured alone, then the smallest kept set found by
    bisection; writes report.md, report.html, debug.json and plan.json. Exit status 1 when
    the result fails its final verification."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    check_outputs(json_path, out, out_dir=True)
    _rules_from(rules_from)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=consoles.err,
        transient=True,
    ) as progress:
        task = progress.add_task("load", total=None)
        loaded = _load(spec, sets, weights)
        result = api.debug_precision(
            loaded.module,
            loaded.example_inputs,
            rules=rules,
            budget=budget,
            samples=samples,
            target=target,
            dynamic=dynamic,
            name=spec,
            out=out,
            progress=lambda stage: progress.update(task, description=stage),
        )
    kept = [s.site for s in result.kept]
    consoles.console.print(
        f"{spec}: {render.n(len(result.layers), 'site')} of {', '.join(result.rules)} on "
        f"{result.target}; kept in float32: {', '.join(kept) or 'none'} "
        f"(rel_l2 {result.result.rel_l2:.3g}, tolerance {result.tolerance}, "
        f"{'passed' if result.passed else 'FAILED'})"
    )
    for name in ("report.md", "report.html", "debug.json", "plan.json"):
        render.line(f"  {out / name}")
    render.write_json(json_path, result.to_json())
    if not result.passed:
        raise typer.Exit(1)
