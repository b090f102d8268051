"""The Python API: the same flow as the CLI, on a module and its example inputs.

    import opswap
    model, inputs = ...                      # any nn.Module and a tuple of inputs
    result = opswap.optimize(model, inputs, target="cpu", budget="cosine>=0.9999")
    result.save("out/")                      # plan.json, result.json, report.md/html, model
    fast = result.candidate                  # the optimized module; `model` is untouched

Example inputs are a tensor or a tuple of forward's positional arguments, a dict of
keyword inputs, or an (args, kwargs) pair. Keyword inputs are taken through a
graph.keywords.KeywordCall: the optimized module (and the saved model) then takes
the tensors positionally, the positional ones first and the keyword ones in the
order given, with the non-tensor values baked in; result.notes says which.

This module is the one place that composes the stages: each `opswap` command calls
one function here (`analyze`, `plan`, `replay`, `verify_plan`, `bench_plan`,
`optimize_loaded`, ...) and prints what it returns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from opswap import planner
from opswap.backends import registry
from opswap.bench.device import check_device as check_device  # the CLI checks it first
from opswap.bench.timing import with_timer
from opswap.config import Exactness, OptimizeConfig
from opswap.errors import ExportError
from opswap.graph.calibrate import Calibration, attach
from opswap.graph.capture import Captured, Method, as_inputs
from opswap.graph.capture import capture as _capture
from opswap.graph.copies import preserved_state, private_copy
from opswap.graph.inputs import fresh
from opswap.graph.keywords import KeywordCall, keyword_call, positional
from opswap.models import LoadedModel
from opswap.models import load as _load
from opswap.models._common import CalibrationSource
from opswap.models.task import Task
from opswap.pipeline import optimize as _optimize
from opswap.planner import Plan, apply_plan
from opswap.result import Result
from opswap.rules.apply import Applied
from opswap.stages import guarded, held_out, verify_on_data
from opswap.targets import Target, get_target
from opswap.verify.outputs import Verification, capture_check
from opswap.verify.tolerance import Tolerance, tolerance_for


def capture(
    model: nn.Module, example_inputs, method: Method = "auto", *, dynamic: str | None = "auto"
) -> Captured:
    """Capture `model` as graph.capture.capture does, checking that the graph reproduces
    the module's outputs (the verifier's comparison, which also measures a low-precision
    model's own rounding)."""
    return _capture(model, example_inputs, method, dynamic=dynamic, check=capture_check)


def load(spec: str, weights: str | None = None, **overrides) -> LoadedModel:
    """Load a model spec (zoo:NAME, hf:TYPE, file.py:fn, ...); overrides as keyword args;
    `weights`: a .safetensors or torch.save state dict copied into the model built."""
    return _load(spec, {k: str(v) for k, v in overrides.items()}, weights=weights)


def analyze(
    model: nn.Module,
    example_inputs,
    target: str | Target = "cpu",
    *,
    dynamic: str = "auto",
    name: str | None = None,
):
    """Per-op FLOPs, bytes, intensity and bound of `model` on `target` (an Analysis, whose
    notes hold the capture's, and whose bottleneck sentences name the rules that would
    relieve them); `name` names the model in its title."""
    from opswap.cost.analyze import analyze as _analyze
    from opswap.report.advice import advised

    captured = capture(*keyword_call(model, example_inputs), dynamic=dynamic)
    return advised(_analyze(captured, get_target(target), model_name=name))


def plan(
    model: nn.Module,
    example_inputs,
    *,
    target: str | Target = "cpu",
    rules: list[str] | str | None = None,
    exactness: str = "exact",
    dynamic: str = "auto",
    name: str | None = None,
    calibration_data: Any = None,
) -> Plan:
    """Choose replacements for `model`; the Plan can be saved, edited and re-applied.
    With `calibration_data` (input batches, stacked samples or a file: graph.
    calibration_data's forms) and `exactness` above exact, static int8 is planned,
    calibrated on every batch of it; the plan keeps the scales it chose."""
    captured = capture(*keyword_call(model, example_inputs), dynamic=dynamic)
    if calibration_data is not None and exactness != "exact":
        samples, where = _samples(calibration_data, captured)
        attach(captured.gm, Calibration(samples, source=f"batches from {where}"))
    return planner.make_plan(
        captured,
        target=with_timer(get_target(target)),
        rules=rules,
        exactness=exactness,
        model_name=name or type(model).__name__,
    )


def read_plan(plan: Plan | str | Path, *, allow_looser: bool = True) -> Plan:
    """A Plan from plan.json (a Plan passes through). Without `allow_looser`, a decision
    looser than the plan's exactness is refused now, before any model is loaded."""
    from opswap.rules import registry

    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if not allow_looser:
        planner.check_exactness(plan, [registry.get(d.rule) for d in plan.decisions])
    return plan


@dataclass
class Replay:
    """A plan replayed on a model: the plan, the capture, what applying it gave (its
    `failed` lists the decisions that could not be applied) and the files written."""

    plan: Plan
    captured: Captured
    applied: Applied
    files: dict[str, Path] = field(default_factory=dict)
    #: where the static int8 scales came from, in a sentence; None without such sites
    calibration: str | None = None
    #: the user's batches verification judges on (the calibration data given, a quarter
    #: held out of calibration from stages.HOLD_OUT_FROM batches up), and which, in words;
    #: None: the example and random samples
    data: list[tuple[Any, ...]] | None = None
    data_said: str = ""


def _samples(data: Any, captured: Captured, where: str = "") -> tuple[list[tuple], str]:
    """`data` (graph.calibration_data's forms, or a CalibrationSource) as input tuples
    for `captured`, and where they come from (`cal.pt`), for the notes."""
    from opswap.graph.calibration_data import batches

    if isinstance(data, CalibrationSource):  # a spec file's calibration(), read now
        data, where = data.fetch(), data.where
    if not where:
        where = Path(data).name if isinstance(data, str | Path) else "calibration_data"
    return batches(data, captured.example_inputs, where), where


def _from(data: Any, captured: Captured) -> tuple[list[tuple], str]:
    """_samples with the words the calibration notes use (`batches from cal.pt`)."""
    samples, where = _samples(data, captured)
    return samples, f"batches from {where}"


def spec_calibration(loaded: LoadedModel) -> CalibrationSource | None:
    """What a loaded spec offers to calibrate static int8 on when a plan holds no scales
    that fit: its file's `calibration()`, else its task's training batches (as many as
    `optimize` takes by default)."""
    if loaded.calibration is not None:
        return loaded.calibration
    task = loaded.task
    if task is not None and task.calibration:
        n = OptimizeConfig.calibration_samples
        return CalibrationSource(lambda: task.calibration[:n], "the task's training batches")
    return None


def replay(
    model: nn.Module,
    example_inputs,
    plan: Plan | str | Path,
    *,
    dynamic: str = "auto",
    allow_looser: bool = True,
    out: str | Path | None = None,
    calibration_data: Any = None,
    calibration_fallback: CalibrationSource | None = None,
) -> Replay:
    """Apply `plan` to a capture of `model` at the sizes `dynamic` keeps symbolic; with
    `out`, save the result there (model.pt2, or its weights when it does not export).
    The decisions that do not apply are left out and listed, the rest applied.

    Static int8 decisions are calibrated afresh on `calibration_data` when it is given
    (every batch: graph.calibration_data's forms); else they take the scales the plan
    holds, when this model has the weights the plan was made with; else they calibrate on
    `calibration_fallback` (a spec's calibration()); else a CalibrationError names
    --calibration. `Replay.calibration` says which."""
    from opswap.artifact import save_model

    plan = read_plan(plan, allow_looser=allow_looser)
    captured = capture(*keyword_call(model, example_inputs), dynamic=dynamic)
    samples = _samples(calibration_data, captured) if calibration_data is not None else None
    data, data_said, every = None, "", None
    if samples is not None:
        every = samples[0]
        calibrate_on, data, data_said = held_out(every, samples[1])
        samples = (calibrate_on, f"batches from {samples[1]}")
    fallback = None
    if calibration_fallback is not None:
        src = calibration_fallback
        fallback = lambda: _from(src, captured)  # noqa: E731
    said = planner.calibrate_replay(
        captured,
        plan,
        samples[0] if samples else None,
        samples[1] if samples else "",
        fallback,
    )
    if said is None and samples is not None and every is not None:
        said = "the calibration data was not used: the plan has no static int8 decision"
        data = every  # none calibrated: verification judges on every batch
        data_said = f"the {len(every)} {samples[1]}"
    applied = apply_plan(captured, plan, allow_looser=allow_looser)
    files: dict[str, Path] = {}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        files = save_model(applied.gm, captured.example_inputs, Path(out), dynamic=captured.dynamic)
    return Replay(plan, captured, applied, files, said, data, data_said)


def _replayed(
    model: nn.Module,
    example_inputs: Any,
    plan: Plan | str | Path,
    dynamic: str,
    calibration_data: Any,
    calibration_fallback: CalibrationSource | None,
) -> tuple[nn.Module, Any, Replay]:
    """(model, inputs) as `keyword_call` makes them, and `replay` of `plan` on them."""
    model, inputs = keyword_call(model, example_inputs)
    done = replay(
        model,
        inputs,
        plan,
        dynamic=dynamic,
        calibration_data=calibration_data,
        calibration_fallback=calibration_fallback,
    )
    return model, inputs, done


def apply(
    model: nn.Module,
    example_inputs,
    plan: Plan | str,
    *,
    allow_looser: bool = False,
    calibration_data: Any = None,
) -> nn.Module:
    """Apply a Plan (or a path to plan.json) to a copy of `model`; returns the new module,
    which takes keyword inputs positionally (see the module doc) and refuses inputs outside
    the sizes it was captured at. A decision looser than the plan's exactness is refused
    unless `allow_looser`. Static int8 decisions take the scales the plan holds, or
    calibrate again on `calibration_data` (see `replay`)."""
    model, inputs = keyword_call(model, example_inputs)
    done = replay(model, inputs, plan, allow_looser=allow_looser, calibration_data=calibration_data)
    return guarded(done.applied.gm, done.captured, model)


@dataclass
class PlanCheck:
    """A replayed plan's verification against the model, the tolerance it was held to,
    and, when it failed, the first layer where the two diverge. With a runtime backend
    that exposes its intermediate values (ort, openvino), `runtime_layers` compares each
    of them with PyTorch running the same exported graph, when asked for or when the
    verification failed (a verify.layers.LayerReport, or a sentence why it could not be
    made), and `runtime_divergence` is its first row past the tolerance."""

    replay: Replay
    verification: Verification
    tolerance: Tolerance
    first_divergence: Any = None  # verify.layers.Divergence
    runtime_layers: Any = None
    runtime_divergence: Any = None


def backends() -> tuple[str, ...]:
    """Where `verify_plan` and `bench_plan` run the model and the plan's result: pytorch, or a
    runtime of backends.registry that offers itself as a backend."""
    return ("pytorch", *(r.name for r in registry.runtimes() if r.backend))


def _check_backend(backend: str) -> None:
    known = backends()
    if backend not in known:
        raise ExportError(f"Unknown backend {backend!r}; use {', '.join(known)}.")
    if backend == "pytorch":
        return
    absent = registry.get(backend).missing(f"--backend {backend}")
    if absent is not None:
        raise ExportError(absent)


def _in_runtime(
    module: nn.Module, captured: Captured, what: str, backend: str, *, mine: bool = True
) -> tuple[nn.Module, Any]:
    """`module` exported (dynamic as the capture claims) and loaded in the `backend`
    runtime on the CPU, as the race makes its file (the runtime's `build`, backends.registry:
    opswap's when `mine`, else as the runtime makes it without opswap): the runtime's
    module, and the exported program it was written from."""
    from opswap.backends.pt2 import _first_line
    from opswap.backends.pt2 import export as _export

    xs = captured.example_inputs
    with preserved_state(module):
        try:
            with torch.no_grad():
                exported = _export(module, tuple(xs), captured.dynamic, runtime=True)
        except Exception as e:
            raise ExportError(f"{what} could not be exported: {_first_line(e)}.") from e
        rt = registry.get(backend)
        art = rt.build(None, xs, captured.dynamic, exported=exported, mine=mine)
    if art.module is None:
        raise ExportError(f"{what} could not be run in {rt.title}: {art.error}")
    return art.module, exported[0]


def _runtime_layers(program, backend: str, captured: Captured, tol: Tolerance):
    """backends.runtime_layers' report of `program` in `backend` and its first divergence,
    or a sentence why there is none."""
    from opswap.backends.runtime_layers import runtime_layers

    rt = registry.get(backend)
    if not rt.layer_forms:
        return f"{rt.title} {rt.no_layers}, so there is no layer-by-layer comparison in it", None
    # translated as the runtime's build writes opswap's file for it (for ORT with onnxscript's
    # fusions, and without them where ORT refuses those, as ort_artifact does)
    why = ""
    for int8, fusions in rt.layer_forms:
        try:
            report = runtime_layers(
                program, backend, captured.example_inputs, int8=int8, fusions=fusions
            )
            break
        except ExportError as e:
            why = str(e)
    else:
        return f"no layer-by-layer comparison in {rt.title}: {why}", None
    return report, report.first_divergence(tol)


def verify_plan(
    model: nn.Module,
    example_inputs,
    plan: Plan | str | Path,
    *,
    budget: str | None = None,
    samples: int = 3,
    dynamic: str = "auto",
    backend: str = "pytorch",
    layers: bool = False,
    calibration_data: Any = None,
    calibration_fallback: CalibrationSource | None = None,
) -> PlanCheck:
    """Verify what `plan` makes of `model` against (a copy of) the model itself, at every
    shape the capture claims, with the plan's exactness defaults (loosened to the model's
    own rounding) and `budget` on top. Every decision is judged as the plan holds it.
    `backend` "ort", "openvino" or "executorch" verifies the plan's result exported and
    run in that runtime on the CPU; with `layers` (and whenever verification fails), a
    runtime that exposes its intermediate values is also compared with PyTorch layer by
    layer (PlanCheck.runtime_layers); with `layers` and no backend, the plan's graph is
    compared with the capture layer by layer in PyTorch, in the same place."""
    from opswap.verify.layers import compare_layers
    from opswap.verify.outputs import verify as _verify

    _check_backend(backend)
    model, inputs, done = _replayed(
        model, example_inputs, plan, dynamic, calibration_data, calibration_fallback
    )
    captured = done.captured
    tol = tolerance_for(done.plan.settings.exactness, budget, captured.rounding)
    candidate: nn.Module = done.applied.gm
    program = None
    if backend != "pytorch":
        candidate, program = _in_runtime(candidate, captured, "The plan's result", backend)
    if done.data is not None:  # the user's batches, as optimize judges a calibrated run
        v = verify_on_data(
            private_copy(model), candidate, done.data, captured, samples=samples, tolerance=tol
        )
    else:
        v = _verify(
            private_copy(model),
            candidate,
            captured.example_inputs,
            samples=samples,
            tolerance=tol,
            variants=captured.variants(),
            graph=captured.gm,
            dynamic=captured.dynamic,
        )
    first = None
    if not v.passed:
        first = compare_layers(captured, done.applied, captured.example_inputs).first_divergence(
            tol
        )
    check = PlanCheck(done, v, tol, first)
    if backend == "pytorch" and layers:
        # in PyTorch: each value of the plan's graph against the same one of the capture
        report = compare_layers(captured, done.applied, captured.example_inputs)
        check.runtime_layers, check.runtime_divergence = report, report.first_divergence(tol)
    if program is not None and (layers or not v.passed):
        check.runtime_layers, check.runtime_divergence = _runtime_layers(
            program, backend, captured, tol
        )
    return check


@dataclass
class PlanBench:
    """A replayed plan timed against the model: the replay and the bench.stats.ModelBench."""

    replay: Replay
    benchmark: Any


def bench_plan(
    model: nn.Module,
    example_inputs,
    plan: Plan | str | Path,
    *,
    device: str = "cpu",
    dynamic: str = "auto",
    backend: str = "pytorch",
    calibration_data: Any = None,
    calibration_fallback: CalibrationSource | None = None,
) -> PlanBench:
    """Time (a copy of) `model` and what `plan` makes of it side by side on `device`;
    `backend` "ort", "openvino" or "executorch" times both exported and run in that
    runtime on the CPU, the comparison a user deploying on it makes (each file made as the
    race makes it: the runtime's `build`, backends.registry)."""
    from opswap.bench.compare import bench_models

    _check_backend(backend)
    model, inputs, done = _replayed(
        model, example_inputs, plan, dynamic, calibration_data, calibration_fallback
    )
    ref: nn.Module = private_copy(model)
    opt: nn.Module = done.applied.gm
    if backend != "pytorch":
        if device != "cpu":
            raise ExportError(
                f"--backend {backend} times on {registry.get(backend).title} on the CPU; "
                "use --device cpu."
            )
        ref, _ = _in_runtime(ref, done.captured, "Your model", backend, mine=False)
        opt, _ = _in_runtime(opt, done.captured, "The plan's result", backend)
    return PlanBench(done, bench_models(ref, opt, done.captured.example_inputs, device=device))


@dataclass
class Exported:
    """A plan's result exported for a runtime: the replay, the file written, the axes it
    keeps dynamic (a note when fewer than the capture's), and its verification, in that
    runtime, against the model."""

    replay: Replay
    path: Path
    verification: Verification
    note: str | None = None
    first_divergence: Any = None  # render.verification's field; layers are not compared


def check_export(to: str) -> None:
    """Refuse, in one sentence, an export format opswap does not write or whose runtime is
    not installed: before a model is loaded or a plan read."""
    formats = registry.export_formats()
    if to not in formats:
        raise ExportError(f"Export to {to!r} is not available; use --to {' or '.join(formats)}.")
    absent = cast(registry.Runtime, registry.for_export(to)).missing(f"Export to {to}")
    if absent is not None:
        raise ExportError(absent)


def export(
    model: nn.Module,
    example_inputs,
    plan: Plan | str | Path,
    *,
    to: str = "onnx",
    out: str | Path,
    samples: int = 3,
    dynamic: str = "auto",
    calibration_data: Any = None,
    calibration_fallback: CalibrationSource | None = None,
) -> Exported:
    """What `plan` makes of `model`, exported to OUT/model.onnx (`to` "onnx" or "ort": the
    same file, for ONNX Runtime), to OUT/model.xml and OUT/model.bin (`to` "openvino":
    OpenVINO's IR, float32) or to OUT/model.pte (`to` "executorch" or "pte": an
    ExecuTorch program with the XNNPACK delegate) with the capture's dynamic axes, and
    verified in its runtime against (a copy of) the model at every size the file keeps
    (the IR as loaded back from OUT). Static int8 decisions take the scales the plan
    holds, or calibrate on `calibration_data` (see `replay`), and are written as int8
    operators (QuantizeLinear/DequantizeLinear around the Conv or MatMul; MatMulInteger
    for ONNX Runtime's Linears)."""
    import shutil

    from opswap.graph.dynamic import variants
    from opswap.verify.outputs import verify as _verify

    check_export(to)
    model, inputs, done = _replayed(
        model, example_inputs, plan, dynamic, calibration_data, calibration_fallback
    )
    captured = done.captured
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rt = cast(registry.Runtime, registry.for_export(to))
    gm, xs = done.applied.gm, captured.example_inputs
    art = rt.build(gm, xs, captured.dynamic, export=True, portable=True)
    if art.module is None or art.path is None:
        raise ExportError(
            f"The plan's result could not be exported to {rt.exported_as}: {art.error}"
        )
    kept = art.kept if art.kept is not None else captured.dynamic
    tol = tolerance_for(done.plan.settings.exactness, None, captured.rounding)
    dest = out / rt.file
    for name, data in rt.beside_of(art.path).items():  # first: the file reads them by name
        if data.is_file():
            shutil.copyfile(data, out / name)
    shutil.copyfile(art.path, dest)
    # a file its runtime loads back (OpenVINO's IR) is verified as it lies in OUT, reopened
    module = rt.load(dest) if rt.reload else art.module
    if done.data is not None:  # the user's batches, at the sizes the file keeps
        v = verify_on_data(
            private_copy(model),
            module,
            done.data,
            captured,
            samples=samples,
            tolerance=tol,
            variants=variants(xs, kept),
            dynamic=kept,
        )
    else:
        v = _verify(
            private_copy(model),
            module,
            xs,
            samples=samples,
            tolerance=tol,
            variants=variants(xs, kept),
            graph=captured.gm,
            dynamic=kept,
        )
    return Exported(done, dest, v, art.note)


def timing_note(target: str | Target, device: str) -> str | None:
    """A sentence when times measured on `device` are not times on `target` (a plan made
    for an H200 timed on this CPU); None when they are."""
    from opswap.bench.timing import describe_device

    tgt = get_target(target)
    here = describe_device(device)
    dev = device.split(":")[0]
    same = (tgt.kind == "cpu" and dev == "cpu") or (
        tgt.kind == dev
        and re.search(rf"\b{re.escape(tgt.name.lower())}\b", here.lower()) is not None
    )
    if same:
        return None
    return (
        f"the plan is made for {tgt.name} ({tgt.description}), but times are measured "
        f"here, on {here}."
    )


def verify(
    reference: nn.Module,
    candidate: nn.Module,
    example_inputs,
    *,
    exactness: str = "exact",
    budget: str | None = None,
    samples: int = 3,
    dynamic: str = "auto",
):
    """Compare candidate with reference on random samples shaped like `example_inputs`, and
    at the other batch sizes and sequence lengths `dynamic` marks (see graph.dynamic).
    Both run as private copies: neither module is called nor changed. A copy keeps the
    hooks and parametrisations that compute weights (weight_norm, spectral_norm), so it
    computes what its module computes when called, and drops the user's other hooks (as
    `optimize` does, which notes them). With keyword inputs
    the reference is called with keywords, and so is the candidate unless it is a graph
    opswap made (an fx.GraphModule), which takes them positionally. Outputs of class
    scores are also judged centred per row and by their top-1/top-5 agreement
    (verify.decisions); the reference's FX trace, where it traces, names its linear heads."""
    from opswap.graph.dynamic import detect, variants
    from opswap.verify.decisions import traced
    from opswap.verify.outputs import verify as _verify
    from opswap.verify.rounding import own_rounding

    reference, inputs = keyword_call(reference, example_inputs)
    candidate = positional(candidate, reference)
    reference, candidate = _private(reference), _private(candidate)
    inputs = fresh(as_inputs(inputs))  # the caller's tensors are never run on
    tol = tolerance_for(
        exactness,
        budget,
        own_rounding(reference, inputs) if isinstance(reference, nn.Module) else None,
    )

    def run(xs):
        with torch.no_grad(), preserved_state(reference):
            reference(*fresh(xs))

    dyn = detect(run, inputs, dynamic)
    return _verify(
        reference,
        candidate,
        inputs,
        samples=samples,
        tolerance=tol,
        variants=variants(inputs, dyn),
        graph=traced(reference),  # which outputs come from a linear head (logits)
        dynamic=dyn,
    )


def _private(fn):
    return private_copy(fn) if isinstance(fn, nn.Module) else fn


def bench(reference: nn.Module, candidate: nn.Module, example_inputs, *, device: str = "cpu"):
    """Time reference and candidate side by side, interleaved, after warm-up; keyword inputs
    as for `verify`."""
    from opswap.bench.compare import bench_models

    reference, inputs = keyword_call(reference, example_inputs)
    candidate = positional(candidate, reference)
    return bench_models(_private(reference), _private(candidate), as_inputs(inputs), device=device)


def optimize(
    model: nn.Module,
    example_inputs,
    *,
    target: str = "cpu",
    rules: list[str] | str | None = None,
    exactness: str = "exact",
    budget: str | None = None,
    samples: int = 3,
    bench: bool = True,
    device: str = "cpu",
    dynamic: str = "auto",
    keep_hooks: bool = False,
    compare: str = "compile",
    export: str | None = None,
    name: str | None = None,
    task: Task | None = None,
    calibration_data: Any = None,
    save: str = "winner",
    search: str = "greedy",
    search_budget: int = 12,
) -> Result:
    """The whole flow: analyze, plan, apply, verify (rolling back what breaks the budget),
    bench, and the race of variants against `compare`'s baselines ("compile", "ort",
    "openvino", "executorch", "tvm" or "none"); `export="onnx"` (or "ort") races ONNX Runtime and
    saves model.onnx, `export="openvino"` races OpenVINO and saves its IR (model.xml and
    model.bin), `export="executorch"` races ExecuTorch and saves model.pte.
    `model` is never called nor changed; `result.candidate` is the optimized module and
    `result.saved_module` the race's winner, which `result.save` writes. The user's hooks
    are left out, with a note; `keep_hooks=True` refuses a model that has any instead.
    With a `task` (models.task.Task: a metric over a held-out split), `result.accuracy`
    holds it for the model and for the saved variant (result.json's `accuracy`).
    `calibration_data` is what static int8 (exactness "approx" or looser) calibrates on,
    every batch of it: a list of input batches (each a tensor, or a tuple of forward's
    positional inputs), one tensor of stacked samples cut into batches of the example's
    size, or the path of a .pt, .npy or .npz file holding either; without it, a task's
    training batches, else random samples like the example. The plan keeps the scales,
    so `opswap apply` and `opswap export` remake the same int8 model from plan.json.
    `save="candidate"` makes `result.save` write opswap's candidate even where the race's
    winner is another variant (your model, or its compiled form): result.json's `save`
    and the report give its measured speed and accuracy beside the winner's; a candidate
    that fails verification raises OpswapError instead. `search="joint"` replaces the
    greedy plan by the fastest whole plan within the budget, `search_budget` plans
    measured at most (tuning.search; result.json's `search`)."""
    config = OptimizeConfig(
        target=target,
        rules=rules or [],
        exactness=cast(Exactness, exactness),  # OptimizeConfig refuses any other word
        budget=budget,
        samples=samples,
        bench=bench,
        device=device,
        dynamic=dynamic,
        keep_hooks=keep_hooks,
        compare=compare,
        export=export,
        save=save,
        search=cast(Any, search),  # OptimizeConfig refuses any other word
        search_budget=search_budget,
    )
    name = name or type(model).__name__
    model, example_inputs = keyword_call(model, example_inputs)
    result = _optimize(
        model, example_inputs, config, name=name, task=task, calibration_data=calibration_data
    )
    note_inputs(result, model)
    _sparsity_curve(result, model, task, config.device)
    return result


def _sparsity_curve(result: Result, model: nn.Module, task: Task | None, device: str) -> None:
    """Where a sparsity rule ran on a model with a task, its metric against sparsity."""
    rules = {s.rule for s in result.applied if s.rule.startswith("sparsity.")}
    if task is None or not rules:
        return
    from opswap.train.finetune_sparse import task_curve

    result.sparsity = task_curve(model, task, rules, device=device).to_json()


def optimize_loaded(
    loaded: LoadedModel, config: OptimizeConfig, *, name: str | None = None, progress=None
) -> Result:
    """`optimize` on a loaded spec with settings already checked (the CLI's flow): the
    loader's settings go into result.json, its notes (keyword inputs, the weights file
    read) into result.notes, and the accuracy of its task, when it has one, into
    result.accuracy. Static int8 calibrates on `config.calibration` (a file), else on the
    spec file's `calibration()`, else on its task's batches or random samples."""
    from opswap.models.weights import describe_record

    data, where = None, "calibration_data"
    if (
        loaded.calibration is not None
        and config.calibration is None
        and config.exactness != "exact"
    ):
        data, where = loaded.calibration.fetch(), loaded.calibration.where  # the file wins
    result = _optimize(
        loaded.module,
        loaded.example_inputs,
        config,
        name=name or loaded.spec,
        progress=progress,
        model_settings=loaded.settings,
        task=loaded.task,
        calibration_data=data,
        calibration_from=where,
    )
    note_inputs(result, loaded.module)
    _sparsity_curve(result, loaded.module, loaded.task, config.device)
    if loaded.settings.get("weights"):
        result.notes.insert(0, describe_record(loaded.settings["weights"]).capitalize() + ".")
    return result


def load_rules(modules: list[str] | None) -> list[str]:
    """Load the rules @register'ed in `modules` (names on the Python path or .py files);
    returns one sentence per installed plugin that was left out (the built-in rules work
    without them)."""
    from opswap.rules import registry

    for module in modules or []:
        registry.load_module(module)
    return registry.problems()


def debug_precision(
    model: nn.Module,
    example_inputs,
    *,
    rules: list[str] | str | None = None,
    budget: str | None = None,
    samples: int = 3,
    target: str | Target = "cpu",
    dynamic: str = "auto",
    name: str | None = None,
    out: str | Path | None = None,
    progress=None,
):
    """The mixed-precision debugger (opswap.verify.mixed): each site of the `rules`' scheme
    (default precision.bf16) measured alone, and the smallest set found to keep in float32
    so that the output meets `budget` (default: the rules' exactness). With `out`, writes
    debug.json, plan.json, report.md and report.html there; returns the MixedPrecision."""
    from opswap.report.mixed_report import write_report
    from opswap.rules import registry
    from opswap.verify.mixed import DEFAULT_RULES
    from opswap.verify.mixed import debug_precision as _debug

    patterns = list(registry.parse_patterns(rules)) or list(DEFAULT_RULES)
    captured = capture(*keyword_call(model, example_inputs), dynamic=dynamic)
    result = _debug(
        model,
        captured=captured,
        rules=patterns,
        tolerance=budget,
        samples=samples,
        target=with_timer(get_target(target)),
        name=name or type(model).__name__,
        progress=progress,
    )
    if out is not None:
        write_report(result, out)
    return result


def list_rules() -> list[dict[str, Any]]:
    """Every rule's info (name, family, chapter, exactness, targets, description) and its
    origin: opswap, a --rules-from module or an installed package."""
    from opswap.rules import registry

    rows = [{**r.info(), "origin": registry.origin(r.name)} for r in registry.all_rules()]
    return rows + _onnx_rules()


def _onnx_rules() -> list[dict[str, Any]]:
    """The rules on ONNX graphs (`opswap plan|optimize model.onnx`), listed beside the
    PyTorch ones; none where the onnx extra is not installed."""
    try:
        from opswap.onnx.rules import onnx_rule_classes
    except ImportError:
        return []
    return [
        {
            "name": r.name,
            "family": r.family,
            "chapter": r.chapter,
            "exactness": r.exactness,
            "targets": ["onnxruntime"],
            "description": r.description,
            "anchors": [],
            "phase": "onnx",
            "after": [],
            "before": [],
            "origin": "opswap",
        }
        for r in onnx_rule_classes()
    ]


def list_models() -> dict[str, Any]:
    """The built-in zoo (name, description, chapters) and the Hugging Face model types
    `hf:` builds from a config, with the kind of each type checked end to end."""
    from opswap.models import list_hf_types, list_zoo
    from opswap.models.hf import hf_kinds

    return {
        "zoo": [
            {"name": z.name, "description": z.description, "chapters": list(z.chapters)}
            for z in list_zoo()
        ],
        "hf": list(list_hf_types()),
        "hf_kinds": hf_kinds(),
    }


def note_inputs(result: Result, model: nn.Module) -> None:
    """Record in result.notes the positional order a KeywordCall model's result takes."""
    if isinstance(model, KeywordCall):
        what = "takes keyword inputs" if model.keywords else "was given inputs that are not tensors"
        result.notes.insert(
            0, f"The model {what}; the optimized model (and model.pt2) " + model.describe() + "."
        )
