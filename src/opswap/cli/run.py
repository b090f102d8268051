"""`opswap optimize`: the whole flow on one model, with a progress bar, and its summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from opswap import api
from opswap.artifact import CandidateFailed
from opswap.cli import commands, consoles, onnx_files, render
from opswap.cli.app import app, check_outputs, overrides
from opswap.cli.options import (
    _DEVICES,
    _STAGES,
    CalibrationOpt,
    DynamicOpt,
    ExactOpt,
    JsonOpt,
    RulesFromOpt,
    RulesOpt,
    SetOpt,
    Spec,
    TargetOpt,
    WeightsOpt,
)
from opswap.config import Exactness
from opswap.errors import OpswapError
from opswap.report.candidates import kept_text, random_check_text
from opswap.verify.metrics import RESOLUTION_NOTE, shown, within_resolution


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
            help="Baselines raced in the same run, comma-separated: compile (torch.compile of the input and of opswap's result), ort (both exported to ONNX and run in ONNX Runtime), openvino (the same .onnx files compiled by OpenVINO for the CPU), executorch (both lowered to ExecuTorch programs with the XNNPACK delegate), tvm (both compiled by Apache TVM for this CPU, untuned), or none.",
        ),
    ] = "compile",
    export: Annotated[
        str | None,
        typer.Option(
            "--export",
            metavar="FORMAT",
            help="onnx or ort: race the ONNX Runtime variants too and save DIR/model.onnx, the faster verified .onnx file (your model's export or opswap's); openvino: the same with OpenVINO and its IR, DIR/model.xml + model.bin (float32), loaded back and verified once saved; executorch (or pte): the same with ExecuTorch and DIR/model.pte.",
        ),
    ] = None,
    calibrate: Annotated[
        str,
        typer.Option(
            metavar="METHOD",
            help="Static int8's activation ranges from calibration: minmax, percentile, mse or entropy.",
        ),
    ] = "minmax",
    calibration: CalibrationOpt = None,
    calibration_samples: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Without --calibration (or a spec file's calibration()): how many random "
            "samples, or batches of a zoo model's training split, static int8 calibrates on.",
        ),
    ] = 8,
    symmetric: Annotated[
        bool,
        typer.Option(
            "--symmetric/--asymmetric",
            help="Static int8 activations symmetric around zero, or asymmetric with a zero point.",
        ),
    ] = False,
    save: Annotated[
        str,
        typer.Option(
            "--save",
            metavar="WHAT",
            help="winner: save the race's fastest verified variant (your model when nothing "
            "opswap made is faster); candidate: save opswap's model (with --export, its "
            "file for that runtime) even when it loses the race, with its measured speed and "
            "accuracy beside the winner's; a candidate that fails verification is refused.",
        ),
    ] = "winner",
    per_tensor: Annotated[
        bool,
        typer.Option(
            "--per-tensor", help="Static int8 weights with one scale per tensor, not per channel."
        ),
    ] = False,
    tuning_db: Annotated[
        Path | None,
        typer.Option(
            "--tuning-db",
            metavar="PATH",
            help="The tuning database: site timings are looked up there before they are "
            "made and written back after (default $OPSWAP_TUNING_DB, else "
            "$XDG_CACHE_HOME/opswap/tuning.sqlite).",
        ),
    ] = None,
    no_tuning_db: Annotated[
        bool,
        typer.Option("--no-tuning-db", help="Time every site afresh; read and write no database."),
    ] = False,
    tuning_top_k: Annotated[
        int | None,
        typer.Option(
            "--tuning-top-k",
            metavar="K",
            help="At a site with more candidates, time only the K the learned cost model "
            "(trained from the tuning database; needs lightgbm) ranks first, and the baseline.",
        ),
    ] = None,
    search: Annotated[
        str,
        typer.Option(
            "--search",
            metavar="HOW",
            help="greedy: take every site a rule predicts to pay, rule by rule; joint: start "
            "from greedy's plan and measure whole plans (sites left out, variants forced), "
            "keeping the fastest within the budget.",
        ),
    ] = "greedy",
    search_budget: Annotated[
        int,
        typer.Option(
            "--search-budget", metavar="N", help="With --search joint: measure at most N plans."
        ),
    ] = 12,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="auto|ADDRESS",
            help="With --search joint: run the timings in a Ray cluster (auto: the one this "
            "machine belongs to, else a local one; or its address); default: timed here.",
        ),
    ] = None,
    sets: SetOpt = None,
    weights: WeightsOpt = None,
    rules_from: RulesFromOpt = None,
    json_path: JsonOpt = None,
    train: Annotated[
        bool,
        typer.Option(
            "--train",
            help="Plan for training: only rules valid in training, the lm_head and "
            "cross-entropy fused, every parameter's gradient checked against eager; then "
            "race full training steps (eager, compile, opswap, opswap+compile) with "
            "cross-entropy against random labels of the output's shape.",
        ),
    ] = False,
) -> None:
    """The whole flow: analyze, plan, apply, verify (with rollback), bench, report. Exit
    status 1 when the result fails verification (what was saved is printed)."""
    check_outputs(json_path, out, out_dir=True)
    if onnx_files.is_onnx(spec):
        if save != "winner":
            raise OpswapError(
                f"--save {save} is not available for .onnx specs yet; drop it to run {spec}."
            )
        sets_ = overrides(sets)
        if not onnx_files.optimize(
            spec, sets_, rules, exactness, out, samples, not no_bench, json_path
        ):
            raise typer.Exit(1)
        return
    config = api.OptimizeConfig(
        target=target,
        rules=rules or [],
        exactness=cast(Exactness, exactness),  # OptimizeConfig refuses any other word
        budget=budget,
        samples=samples,
        bench=not no_bench,
        device=device,
        dynamic=dynamic,
        compare=compare,
        export=export,
        calibrate=calibrate,
        calibration_samples=calibration_samples,
        calibration=str(calibration) if calibration is not None else None,
        symmetric_activations=symmetric,
        per_channel_weights=not per_tensor,
        save=save,
        tuning_db="off" if no_tuning_db else (str(tuning_db) if tuning_db is not None else None),
        tuning_top_k=tuning_top_k,
        search=cast(Any, search),  # OptimizeConfig refuses any other word
        search_budget=search_budget,
        ray=ray,
    )
    commands._rules_from(rules_from)
    if train:
        if onnx_files.is_onnx(spec):
            raise OpswapError("--train takes a PyTorch model, not an .onnx file.")
        _train(spec, sets, weights, config, out, json_path)
        return
    if not no_bench:
        commands._timed_where(target, device)
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

        loaded = commands._load(spec, sets, weights)
        try:
            result = api.optimize_loaded(loaded, config, name=spec, progress=step)
        except CandidateFailed as e:  # a verdict, not a usage error: exit status 1
            consoles.err.print(Text.assemble(("error:", "bold red"), " ", str(e)), soft_wrap=True)
            raise typer.Exit(1) from None
        step("report")
        paths = result.save(out)
    data = result.to_json()
    _summary(data)
    for k in ("plan", "result", "report_md", "report_html", "model"):
        if k in paths:
            render.line(f"  {k:<11} {paths[k]}")
    render.inputs(loaded.module)
    said = generation_note(spec)
    if said is not None:
        render.note(said, "generation")
    render.write_json(json_path, data)
    if not data["verification"]["passed"]:
        render.note(
            f"opswap's result did not pass verification ({'; '.join(data['verification']['reasons'])}); "
            f"{paths.get('model', out)} holds {data['deploy']['holds']}; exit status 1.",
            "failed",
            "red",
        )
        raise typer.Exit(1)


def _train(
    spec: str,
    sets: SetOpt,
    weights: WeightsOpt,
    config: api.OptimizeConfig,
    out: Path,
    json_path: JsonOpt,
) -> None:
    """`optimize --train`: train.race.optimize_training, its table, DIR/result.json."""
    import json

    from opswap.train.race import VARIANTS, optimize_training

    loaded = commands._load(spec, sets, weights)
    wanted = [v.strip() for v in str(config.compare).split(",")]
    variants = [v for v in VARIANTS if v in ("eager", "opswap") or "compile" in wanted]
    with consoles.err.status("preparing and racing training steps"):
        race = optimize_training(
            loaded.module,
            loaded.example_inputs,
            target=config.target,
            exactness=config.exactness,
            rules=list(config.rules) or None,
            device=config.device,
            variants=variants if config.bench else ("eager", "opswap"),
            min_time_s=0.5 if config.bench else 0.0,
        )
    prep = race.prepare or {}
    for r in prep.get("replaced", []):
        render.line(f"  replaced  {r['rule']}: {r['description']}")
    for r in prep.get("refused", []):
        render.line(f"  refused   {r['rule']}: {r['reason']}")
    render.line(f"  left      {len(prep.get('left', []))} near miss(es) (result.json lists them)")
    consoles.console.print(race.table(), soft_wrap=True)
    for note in race.notes:
        render.note(note, "note")
    data = {"model": spec, "settings": loaded.settings, **race.to_json()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(data, indent=2, default=str))
    render.line(f"  result      {out / 'result.json'}")
    render.write_json(json_path, data)
    if not all(r.verified for r in race.rows):
        raise typer.Exit(1)


def generation_note(spec: str) -> str | None:
    """For a decoder spec (hf:llama, hf:gpt2, ...): what this run optimized is one forward
    over the whole sequence with no KV cache, which is not what generate() runs token by
    token; where generation goes instead."""
    from opswap.models.hf import hf_kinds

    if not spec.startswith("hf:"):
        return None
    kind = hf_kinds().get(spec[3:].split("?")[0].split(":")[0])
    if kind != "decoder":
        return None
    return (
        "this run optimized one forward over the whole sequence (a prefill) with no KV "
        "cache; generate() runs the model token by token with a cache, which this does not "
        "speed up: for generation use opswap.llm.StaticDecoder (a static KV cache, "
        "split-K decode attention, CUDA graphs; chapter 29, "
        "examples/ch29_static_cache.py)"
    )


def _where(axis: dict, names: list[str]) -> str:
    """Where an axis lies, in words: 'dim 1 of input_ids and attention_mask'."""
    by_dim: dict[int, list[str]] = {}
    for text in axis.get("inputs") or []:  # "input I dim D"
        _, i, _, d = text.split()
        name = names[int(i)] if int(i) < len(names) else f"input {i}"
        by_dim.setdefault(int(d), []).append(name)
    return "; ".join(f"dim {d} of {' and '.join(ns)}" for d, ns in by_dim.items())


def _summary(data: dict) -> None:
    """An optimize run's result.json, in a few lines and the table of variants."""
    from opswap.report.optimize_report import interval

    console = consoles.console
    v, b = data["verification"], data["benchmark"]
    console.print(
        Text.assemble(
            (data["model"], "bold"),
            f" on {data['target']}: "
            f"{render.n(len(data['applied']), 'replacement')}, "
            f"{render.n(len(data['misses']), 'near miss', 'near misses')}, "
            f"{len(data['rolled_back'])} rolled back, {len(data['failed'])} failed",
        )
    )
    for f in data["failed"]:  # a rule that raised: its one-line reason
        console.print(f"  failed: {f['rule']} at {f['key']}: {f['reason']}", markup=False)
    dyn = data.get("dynamic") or {}
    names = [i["name"] for i in (data.get("run") or {}).get("inputs") or []]
    axes = ", ".join(
        f"{a['name']} (example {a['size']}; {_where(a, names)})" for a in dyn.get("axes", [])
    )
    console.print(f"  dynamic sizes: {axes or 'none (the example shapes only)'}", markup=False)
    tuning = data.get("tuning")
    if tuning and tuning.get("sites"):
        console.print(
            f"  tuning db: {tuning['hits']} hit(s), {tuning['near']} near, "
            f"{tuning['misses']} miss(es), {tuning['timings_made']} timing(s) made "
            f"({tuning['db']})",
            markup=False,
        )
    found = data.get("search")
    if found:
        console.print(
            f"  joint search: {found['evaluations']} plan(s) measured in "
            f"{found['seconds']:.1f} s; greedy {found['greedy']['latency_ms']:.3f} ms, chosen "
            f"{found['chosen']['latency_ms']:.3f} ms"
            + (" (greedy kept)" if found["kept_greedy"] else ""),
            markup=False,
        )
    status = ("PASSED", "green") if v["passed"] else ("FAILED", "red")
    console.print(
        Text.assemble(
            "  verification ",
            status,
            f": cosine {v['cosine']:.8f}, max_abs {v['max_abs']:.3g}, "
            f"sqnr {shown(v, 'sqnr_db', '.1f')}{'' if within_resolution(v) else ' dB'} "
            f"({render.n(v['samples'], 'sample')}, "
            f"tolerance {render.tolerance_text(v['tolerance'])})",
        )
    )
    if within_resolution(v):
        console.print(f"  {RESOLUTION_NOTE}", markup=False)
    if v.get("top1_agreement") is not None:
        console.print("  " + render.decisions_text(v), markup=False)
    if data.get("verification_random"):  # the verdict was reached on the user's data
        console.print(f"  verified on your data: {v['on']}", markup=False)
        console.print("  " + cast(str, random_check_text(data)), markup=False)
    if data.get("accuracy"):
        a = data["accuracy"]
        console.print(
            f"  accuracy ({a['metric']}): {a['reference']:.4f} -> {a['candidate']:.4f} "
            f"({100 * (a['candidate'] - a['reference']):+.2f} points, the model saved)",
            markup=False,
        )
    if b:
        console.print(
            f"  your model -> opswap's model.pt2: {b['ref_ms']:.3f} ms -> "
            f"{b['opt_ms']:.3f} ms, "
            f"{interval(b['speedup_of_medians'], b.get('speedup_ci'), b.get('settled'))} "
            f"(ratio of medians, 95% interval; {b['device']})",
            markup=False,
        )
    run = data.get("run") or {}
    if run.get("inputs"):
        shapes = ", ".join(f"{i['name']} {i['dtype']}{list(i['shape'])}" for i in run["inputs"])
        console.print(f"  inputs: {shapes}; {run.get('threads')} threads", markup=False)
    for text in data.get("notes") or []:
        console.print(f"  note: {text}", markup=False)
    if data.get("variants"):
        _variants(data)


def _variants(data: dict) -> None:
    from opswap.report.candidates import accuracy_cell, saved_mark
    from opswap.report.optimize_report import interval, why_text

    table = Table(title="variants, timed in one interleaved run")
    for col in (
        "variant",
        "ms",
        "IQR ms",
        "vs input [95% interval]",
        "verified",
        "accuracy",
        "compile s",
        "note",
    ):
        table.add_column(col, overflow="fold")
    for v in data["variants"]:
        ms = f"{v['ms']:.3f}" if v["ms"] is not None else "-"
        iqr = f"{v['iqr_ms']:.3f}" if v["iqr_ms"] is not None else "-"
        sp = (
            "1.00x (the yardstick)"
            if v["name"] == "input"
            else interval(v["speedup_vs_input"], v.get("speedup_ci"), v.get("settled"))
            if v["speedup_vs_input"] is not None
            else "-"
        )
        comp = f"{v['compile_s']:.1f}" if v["compile_s"] is not None else ""
        name = v["name"] + saved_mark(v["name"], data)
        table.add_row(
            Text(name),
            ms,
            iqr,
            Text(sp),
            "yes" if v["verified"] else "no",
            Text(accuracy_cell(v.get("accuracy"))),
            comp,
            Text(why_text(v)),
        )
    consoles.console.print(table)
    if data.get("timings_settled") is False:
        render.unsettled()
    deploy = data["deploy"]
    render.line(f"  saved: {deploy['variant']}, {deploy['holds']}")
    kept = kept_text(data)
    if kept is not None:
        render.line("  " + kept)
    if deploy.get("verified_as"):
        shapes = deploy["verified_as"].get("shapes") or []
        render.line(
            f"  verified as: {deploy['verified_as']['variant']}"
            + (f", at {', '.join(shapes)}" if shapes else "")
        )
    use = "use" if deploy["how"].startswith("your own") else "load it with"
    render.line(f"  {use} {deploy['how']}; run it under {deploy['run_under']}")
