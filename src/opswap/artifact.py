"""What an optimize run leaves on disk, and loading its model back: the one module for both.

    import opswap
    from opswap import artifact
    paths = artifact.save(result, "out/resnet")   # what result.save("out/resnet") does
    model = artifact.load("out/resnet")           # what opswap.load_optimized does

`save(result, DIR)` writes plan.json, the model, result.json (`describe(result)`) and the
report (report.md, report.html and its plots, which opswap.report renders into DIR). The
model is DIR/model.pt2, the variant that won the race (`deploy`), the very file that was
timed, with model_shapes.txt beside it when the file keeps fewer sizes dynamic than the
capture did; where torch.export fails, the weights go to model_state.pt (a plain
state_dict, `torch.load(..., weights_only=True)`), model_state.txt says why, and plan.json
re-creates the structure: `opswap apply SPEC plan.json`. When an ONNX Runtime variant
won (`--compare ort`, `--export onnx`), the model is DIR/model.onnx instead, the .onnx
file whose session was timed (with model.onnx.data beside it past 2 GB of weights), and
`load` opens it in ONNX Runtime; when an ExecuTorch variant won (`--compare executorch`),
it is DIR/model.pte, the ExecuTorch program (XNNPACK delegate) that was timed, and `load`
opens it in ExecuTorch's runtime; when an OpenVINO variant of `--export openvino` won, it
is OpenVINO's IR, DIR/model.xml with its weights in DIR/model.bin, the IR that was timed,
loaded back from DIR in a fresh OpenVINO Core and verified against the model at every
size it keeps before the run is moved in (result.json's `deploy.reloaded`), and `load`
opens it in OpenVINO; when a TVM variant won (`--compare tvm`), it is DIR/model.so, the
library TVM built for this CPU, and `load` opens it in Relax's VM. No model file is written when the file the winner saves passed no
verification.

DIR then holds exactly this run, never a mix with an earlier one: everything is written
into a temporary folder beside DIR (the same filesystem, so each file moves in with an
atomic rename) and moved in only once all of it is written, so that a save that fails
leaves DIR as it was. Before the move, the files an earlier run wrote that this one does
not (its model.pt2 when this run could only write model_state.pt) are removed. Only the
names opswap writes (`RUN_FILES`) are ever removed: a user's own files in DIR stay. The
model file moves in first and result.json last, so that a reader never finds a
result.json beside a model it does not describe.

`load(DIR)` is the one loader of a saved model.pt2: backends.pt2's, which runs no pickled
code, registers opswap's ops first (by `import opswap`) and checks each call against the
program's guards compiled into one cheap function (graph.guards). When the winner was
a compiled variant, the loaded graph is handed to torch.compile, as it was when timed.
Run it under `torch.inference_mode()` (or `torch.no_grad()`): with autograd recording,
the fused kernels give way to differentiable ones and most of the speed-up is gone.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from opswap.errors import OpswapError

if TYPE_CHECKING:
    from opswap.backends.pt2 import Artifact
    from opswap.bench.variants import Race, VariantTiming
    from opswap.cost.analyze import Analysis
    from opswap.graph.dynamic import Dynamic
    from opswap.record import RunRecord as Result

#: the model files of a run other than a runtime's (backends.registry: each runtime's file
#: and what travels with it are model files too); a save removes those an earlier run left
#: that this one did not
_TORCH_MODELS = ("model.pt2", "model_aoti.pt2", "model_shapes.txt")
#: every other name `save` writes (report.optimize_report's plots included)
_OTHER_FILES = (
    "plan.json",
    "result.json",
    "report.md",
    "report.html",
    "model_state.pt",
    "model_state.txt",
    "latency.png",
    "layer_errors.png",
    "categories.png",
    "roofline.png",
)
_LAST = ("result.json",)


def _runtime_files() -> tuple[str, ...]:
    from opswap.backends import registry

    return tuple(dict.fromkeys(n for rt in registry.runtimes() for n in rt.files()))


#: the model files of a run: model.pt2, its AOTInductor package and note, and every
#: runtime's file with what travels with it
_MODELS = (*_TORCH_MODELS, *_runtime_files())
#: every name `save` writes; only these are ever removed from DIR
RUN_FILES = frozenset((*_MODELS, *_OTHER_FILES))
#: the files moved into DIR first: the model files (not model_shapes.txt, which describes
#: them) and model_state.pt
_FIRST = frozenset(n for n in (*_MODELS, "model_state.pt") if n != "model_shapes.txt")


#: which module a winning variant saves: the input, the plain capture or opswap's candidate
#: (a runtime's variant NAME saves the input's, opswap+NAME the candidate's)
SAVED_MODULE = {
    "input": "input",
    "compile": "input",
    "captured": "captured",
    "opswap": "candidate",
    "opswap+compile": "candidate",
    "opswap+cudagraph": "candidate",
    "compile+cudagraph": "input",
    "opswap+compile+cudagraph": "candidate",
}


def artifact_key(variant: str) -> str:
    """The key in Race.artifacts of the file `variant` saves when it wins (a runtime's
    variant: its own file, backends.registry)."""
    from opswap.backends import registry

    rt = registry.of_variant(variant)
    if rt is not None:
        return rt.key(variant)
    return "candidate" if _module_of(variant) == "candidate" else "input"


def _module_of(variant: str) -> str:
    """Which module `variant` saves when it wins: "input", "captured" or "candidate"."""
    from opswap.backends import registry

    if registry.of_variant(variant) is not None:
        return "candidate" if variant.startswith("opswap+") else "input"
    return SAVED_MODULE.get(variant, "candidate")


class CandidateFailed(OpswapError):
    """`--save candidate` asked for opswap's candidate, and it failed verification: a
    verdict, not a usage error (the CLI exits 1), and nothing is saved."""


def candidate_variant(export: str | None) -> str:
    """The variant whose file is opswap's candidate: `opswap` (model.pt2), or with
    --export the candidate's file for that runtime (`opswap+ort`, ...)."""
    from opswap.backends import registry

    rt = registry.for_export(export) if export is not None else None
    return "opswap" if rt is None else rt.variants[1]


def keep_candidate(race: Race, export: str | None) -> tuple[VariantTiming, dict[str, Any] | None]:
    """What `--save candidate` saves: the race's winner where it already saves opswap's
    candidate, else the candidate's own variant (`candidate_variant`) as timed, with the
    verification its file passed. Raises OpswapError, in one sentence, when that file did
    not pass verification (or was not made): a candidate that fails is never saved."""
    if _module_of(race.winner.name) == "candidate" and (
        export is None or race.winner.name == candidate_variant(export)
    ):
        return race.winner, race.verified_as
    name = candidate_variant(export)
    timing = next((t for t in race.timings if t.name == name), None)
    passed = race.files.get(name)
    if timing is None or not timing.verified or passed is None:
        why = "; ".join(timing.reasons) if timing is not None else "it was not raced"
        raise CandidateFailed(
            f"--save candidate: opswap's {name} did not pass verification "
            f"({why[:300] or 'no reason given'}), so nothing was saved."
        )
    return timing, passed


def saved_kind(result: Result) -> str:
    """Which module the run's winner saves: "input", "captured" or "candidate"."""
    return _module_of(result.best)


def saved_artifact(result: Result) -> Artifact | None:
    """The backends.pt2.Artifact written as model.pt2 (the file the race timed), or None
    when there was no race or the winner's graph did not export."""
    art = result.artifacts.get(artifact_key(result.best))
    return art if art is not None and art.path is not None else None


def saved_module(result: Result) -> nn.Module:
    """The module saved as model.pt2: the winner of the race as reloaded from the file
    that was timed; the input itself when nothing opswap made beat it."""
    art = saved_artifact(result)
    if art is not None and art.module is not None:
        return art.module
    return result.candidate if saved_kind(result) == "candidate" else result.reference


def _saved_file(result: Result, rt: Any) -> str:
    """The name of the file a runtime's winner saves in DIR: its artifact's (the .onnx file
    OpenVINO's race times is ONNX Runtime's model.onnx), else the form the run's --export
    asks for, else the race's."""
    from opswap.backends import registry

    art = saved_artifact(result)
    if art is not None:
        owner = registry.of_file(cast(Path, art.path))
        if owner is not None:
            return owner.file
    if result.config.export in rt.exports:
        return rt.file
    return rt.build_file


def _deploy_runtime(result: Result, rt: Any) -> dict[str, Any]:
    """result.json's `deploy` when a runtime's variant won: its file, in its own words."""
    file = _saved_file(result, rt)
    words = rt.deploy(result.best.startswith("opswap+"), file)
    return {
        "variant": result.best,
        "artifact": file if result.verified_as is not None else None,
        "holds": words.holds,
        "compile": False,
        "how": words.how,
        "timed": saved_artifact(result) is not None,
        "verified_as": result.verified_as,
        "run_under": words.run_under,
    }


def deploy(result: Result) -> dict[str, Any]:
    """What model.pt2 (or model.onnx, model.pte) holds and how to run it (result.json's
    `deploy`)."""
    from opswap.backends import registry

    rt = registry.of_variant(result.best)
    if rt is not None:
        return _deploy_runtime(result, rt)
    kind = saved_kind(result)
    compiled = "compile" in result.best.split("+")
    holds = {
        "input": "your model, unchanged (as exported; its time is the `captured` "
        "row): nothing opswap made beat your model in this run",
        "captured": "your model as exported, with no rewrite",
        "candidate": "opswap's optimized model",
    }[kind]
    how = "opswap.load_optimized(DIR)" + (" (compiles it with torch.compile)" if compiled else "")
    if kind == "input":
        cap = next((v for v in result.variants if v.name == "captured" and v.ms is not None), None)
        if cap is not None and cap.slower and not compiled:
            # The file is the input as exported; where that export ran slower than the
            # module itself, the module is what to keep.
            holds += (
                f"; as exported it ran at {cap.speedup_vs_input:.2f}x of your module, "
                "so keep running your own module"
            )
            how = "your own module, as it is (model.pt2 is its slower export)"
    verified_as = result.verified_as
    if not result.variants:  # no race: what is saved is the candidate verified in memory
        verified_as = {
            "variant": "opswap (in memory, before export; not raced)",
            "shapes": list(result.verification.shapes),
        }
    artifact: str | None = "model.pt2"
    if result.variants and verified_as is None:
        artifact = None
        holds = (
            "nothing: the file your model's export would be (the `captured` row) "
            "did not pass verification, so no model.pt2 is written"
        )
        how = "your own module, as it is"
    graphed = result.best.endswith("cudagraph")
    if graphed and compiled:
        how = (
            "opswap.load_optimized(DIR) (compiles it with torch.compile, its kernels replayed "
            'from CUDA graphs as mode="reduce-overhead" does)'
        )
    elif graphed:
        how = (
            "opswap.load_optimized(DIR) (replays model.pt2 from a CUDA graph captured at the "
            "first call of each input shape)"
        )
    if compiled and result.aot is not None and result.aot.get("package"):
        how = (
            "opswap.load_optimized(DIR) (loads model_aoti.pt2, compiled ahead of time: no "
            "torch.compile at load)"
        )
    out = {
        "variant": result.best,
        "artifact": artifact,
        "holds": holds,
        "compile": compiled,
        "how": how,
        "timed": saved_artifact(result) is not None,
        "verified_as": verified_as,
        "run_under": "torch.inference_mode()",
    }
    if graphed:
        out["cuda_graph"] = True
    if compiled and result.aot is not None:
        out["aot"] = result.aot
    return out


def describe(result: Result) -> dict[str, Any]:
    """What result.json holds: the run's settings, what was applied, missed, failed, rolled
    back and skipped, the verification, the timings and what model.pt2 holds."""
    est = {d.site.key: d.estimate.to_json() for d in result.plan.decisions}
    config = result.config
    return {
        "model": result.model,
        "target": result.target,
        "created": result.created,
        "versions": {
            "opswap": _version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "capture_method": result.plan.capture_method,
        "run": result.run_info,
        "settings": {
            "rules": config.rules,
            "exactness": config.exactness,
            "budget": config.budget,
            "samples": config.samples,
            "dynamic": config.dynamic,
            "export": config.export,
        },
        "dynamic": result.dynamic.to_json() if result.dynamic is not None else None,
        "applied": [
            {
                "rule": s.rule,
                "site": s.key,
                "description": s.description,
                "estimate": est.get(s.key),
            }
            for s in result.applied
        ],
        "misses": [m.to_json() for m in result.plan.misses],
        "failed": [f.to_json() for f in result.failed],
        "rolled_back": [r.to_json() for r in result.rolled_back],
        "skipped": [s.to_json() for s in result.plan.skipped],
        "tuning": result.plan.tuning,
        "search": result.plan.search,
        "verification": {
            **result.verification.to_json(),
            "on": result.verified_on or "the example and random samples like it",
        },
        "verification_random": _random_check(result),
        "accuracy": result.accuracy.to_json() if result.accuracy is not None else None,
        "sparsity": result.sparsity,
        "benchmark": result.benchmark.to_json() if result.benchmark is not None else None,
        "rule_timings": [t.to_json() for t in result.rule_timings],
        "attribution": result.attribution.to_json() if result.attribution is not None else None,
        "variants": [v.to_json() for v in result.variants],
        "best": result.best,
        "save": save_choice(result),
        "timings_settled": result.settled,
        "deploy": _kept_note(result, deploy(result)),
        "analysis": {
            "before": _totals(result.analysis_before),
            "after": _totals(result.analysis_after),
        },
        "notes": result.notes,
    }


def _row(result: Result, name: str | None) -> dict[str, Any] | None:
    """A variant's speed and accuracy, as result.json's `save` shows them side by side."""
    t = next((v for v in result.variants if v.name == name), None)
    if t is None:
        return None
    return {
        "variant": t.name,
        "ms": t.ms,
        "speedup_vs_input": t.speedup_vs_input,
        "speedup_ci": [t.ci_low, t.ci_high],
        "settled": t.settled,
        "accuracy": t.accuracy,
    }


def save_choice(result: Result) -> dict[str, Any]:
    """result.json's `save`: what was asked for (the race's winner, or opswap's candidate),
    what is saved, whether it was kept by request over the race's winner, and both rows'
    measured speed and accuracy."""
    asked = getattr(result.config, "save", "winner")
    return {
        "asked": asked,
        "variant": result.best,
        "kept_by_request": result.race_winner is not None,
        "race_winner": result.race_winner or result.best,
        "saved": _row(result, result.best),
        "winner": _row(result, result.race_winner or result.best),
    }


def _kept_note(result: Result, dep: dict[str, Any]) -> dict[str, Any]:
    """`deploy` of a run that kept opswap's candidate by request: its `holds` says so."""
    if result.race_winner is None:
        return dep
    row = _row(result, result.best)
    ratio = ""
    if row is not None and row["speedup_vs_input"] is not None:
        from opswap.bench.stats import describe_speedup

        speed = describe_speedup(row["speedup_vs_input"], row["speedup_ci"], row["settled"])
        ratio = f"; its speed-up over your model: {speed}"
    dep = dict(dep)
    dep["holds"] = (
        f"{dep['holds']}, kept by request (--save candidate) although the race's winner "
        f"was {result.race_winner}{ratio}"
    )
    if not result.applied:
        dep["holds"] += "; no rule applied, so it computes your model as captured"
    dep["kept_by_request"] = True
    return dep


def _random_check(result: Result) -> dict[str, Any] | None:
    """result.json's `verification_random`: the candidate on random samples like the
    example, reported beside a verdict reached on the user's data, not part of it."""
    check = result.random_check
    if check is None:
        return None
    return {
        **check.to_json(),
        "judged": False,
        "why": "random inputs like the example can sit outside the ranges static int8 "
        "was calibrated for; the verdict is the one on your data",
    }


def save(result: Result, out_dir: str | Path, *, aot: bool | None = None) -> dict[str, Path]:
    """Write the run into `out_dir` (see the module's docstring): plan.json, result.json,
    report.md, report.html and the model; returns the paths by kind. When a compiled
    variant won, model_aoti.pt2 as well (`aot`; None: unless the environment sets
    OPSWAP_AOT=0), its AOTInductor package (backends.aoti)."""
    if aot is None:
        aot = os.environ.get("OPSWAP_AOT", "1") != "0"
    return write_run(out_dir, lambda out: _write(result, out, aot))


def _aot(result: Result, pt2: Path) -> dict[str, Any]:
    """model_aoti.pt2 beside `pt2` (a compiled winner's program): packaged, verified against
    the model at the example's shapes, and both ways to load it timed from nothing to the
    first output (result.json's `deploy.aot`); or why there is no package."""
    from opswap.backends import aoti
    from opswap.backends.int8_inductor import compile_module
    from opswap.backends.pt2 import load as load_program
    from opswap.graph.inputs import fresh
    from opswap.verify.outputs import compare_outputs

    path, why = aoti.package(pt2, pt2.with_name(aoti.PACKAGE))
    if path is None:
        return {"package": None, "why": why}
    inputs = tuple(fresh(result.example_inputs))
    data = _data_at(result, inputs)  # the user's data where the verdict was reached on it
    try:
        # loaded first in a child Python: a package whose loading crashes never reaches
        # this one; run on the user's data where the verdict was reached on it
        probe = data[0] if data else inputs
        outputs, aot_s = aoti.first_call_in_child(path, pt2, probe)
        with torch.no_grad():
            want = result.reference(*fresh(probe))
        off = compare_outputs(want, outputs, result.verification.tolerance)
        if off:
            raise OpswapError("; ".join(off))
        first = {
            "aot": aot_s,
            "compile": aoti.first_call_s(lambda: compile_module(load_program(pt2)), inputs),
        }
    except Exception as e:
        path.unlink(missing_ok=True)
        return {"package": None, "why": f"no AOTInductor package: {str(e).splitlines()[0][:300]}"}
    return {"package": path.name, "load_to_first_call_s": first}


def _write(result: Result, out: Path, aot: bool = True) -> dict[str, Path]:
    from opswap.report import write_reports

    paths = {"plan": result.plan.save(out / "plan.json")}
    reloaded = None
    if not result.variants or result.verified_as is not None:
        # only a file that passed verification at every shape it claims is saved
        art = saved_artifact(result)
        if art is None:  # no race: exported here, and the claim follows the file
            from opswap.backends.pt2 import export_artifact

            art = export_artifact(
                saved_module(result), tuple(result.example_inputs), result.dynamic, out
            )
            result.dynamic = file_claim(result.dynamic, art, result.notes)
        paths.update(
            save_model(
                saved_module(result),
                result.example_inputs,
                out,
                dynamic=result.dynamic,
                artifact=art,
            )
        )
        from opswap.backends import registry

        owner = registry.of_file(paths["model"])
        if owner is not None and owner.reload:
            reloaded = check_reloaded(result, paths["model"], art, owner)
    packaged = None
    if aot and result.best.endswith("compile") and paths.get("model", Path()).name == "model.pt2":
        packaged = _aot(result, paths["model"])
        if packaged["package"] is not None:
            paths["aot"] = out / packaged["package"]
    result.aot = packaged
    data = describe(result)
    if reloaded is not None:
        data["deploy"]["reloaded"] = reloaded
    data["model_files"] = {k: str(v.name) for k, v in paths.items() if k != "plan"}
    paths["result"] = out / "result.json"
    paths["result"].write_text(json.dumps(data, indent=2, default=json_default) + "\n")
    paths.update(write_reports(result, out))
    return paths


def _data_at(result: Result, example: tuple) -> list[tuple] | None:
    """The user's batches the run's verdict was reached on, where each has the example's
    shapes (a file that keeps them static takes no other); None: random samples."""
    data = result.check_data
    if not data:
        return None
    same = [
        b
        for b in data
        if len(b) == len(example)
        and all(
            not isinstance(x, torch.Tensor) or getattr(y, "shape", None) == x.shape
            for x, y in zip(example, b, strict=True)
        )
    ]
    return same or None


def check_reloaded(result: Result, xml: Path, art: Artifact | None, rt: Any) -> dict[str, Any]:
    """The file just written at `xml` (a runtime `rt` loads back: OpenVINO's IR, in a fresh
    Core) loaded back and verified against the model (the run's reference, tolerance and
    samples) at every size the file keeps: result.json's `deploy.reloaded`. Raises
    OpswapError when it does not match, so that the run is not moved in."""
    from opswap.graph.dynamic import variants
    from opswap.verify.outputs import verify

    kept = art.kept if art is not None and art.kept is not None else result.dynamic
    data = _data_at(result, tuple(result.example_inputs))
    inputs = tuple(data[0]) if data else tuple(result.example_inputs)  # as the verdict was
    check = verify(
        result.reference,
        rt.load(xml),  # the output structure and input names from the file itself
        inputs,
        samples=result.config.samples,
        tolerance=result.verification.tolerance,
        seed=result.config.seed,
        variants=variants(inputs, kept) if kept is not None else (),
        given=data,
    )
    if not check.passed:
        raise OpswapError(
            f"The {rt.exported_as} written as {xml.name} does not match your model when loaded "
            f"back ({'; '.join(check.reasons)[:240]}); the run was not saved."
        )
    return {
        "file": xml.name,
        "shapes": list(check.shapes),
        "max_abs": check.max_abs,
        "cosine": check.cosine,
        "passed": True,
    }


def save_model(
    model: nn.Module,
    example_inputs: tuple,
    out: str | Path,
    dynamic: Dynamic | None = None,
    artifact: Artifact | None = None,
) -> dict[str, Path]:
    """Write `model` as OUT/model.pt2 (dynamic along `dynamic`'s axes), or its weights as
    OUT/model_state.pt when it does not export; the other form an earlier save left in OUT
    is removed. With `artifact` (a backends.pt2.Artifact of this model, the file the race
    timed), that very file is copied instead of exporting again."""
    from opswap.backends.pt2 import export_artifact

    out = Path(out)
    if artifact is None or artifact.path is None:
        artifact = export_artifact(model, tuple(example_inputs), dynamic, out)
    if artifact.path is not None:  # the file the race timed (or this export's)
        return _save_file(artifact, out)
    # export can fail on any construct; the state_dict always works
    path = out / "model_state.pt"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _partial_then_replace(path, lambda p: torch.save(state, str(p)))
    # an earlier save's model, not this one
    _remove(out, *_MODELS)
    (out / "model_state.txt").write_text(
        "model.pt2 could not be written because torch.export failed on the optimized "
        f"model: {artifact.error}\n"
        "model_state.pt holds its weights (torch.load(path, weights_only=True)); rebuild "
        "the module with `opswap apply SPEC plan.json`.\n"
    )
    return {"model": path}


def _save_file(artifact: Artifact, out: Path) -> dict[str, Path]:
    """The file the race timed (model.pt2, or a runtime's file with what travels with it:
    model.onnx with its external data file, OpenVINO's model.xml with its model.bin, ...)
    copied into OUT, model_shapes.txt with its note, and every other model file an earlier
    save left removed."""
    from opswap.backends import registry

    src = cast(Path, artifact.path)
    rt = registry.of_file(src)
    path = out / (rt.file if rt is not None else "model.pt2")
    beside = rt.beside_of(src) if rt is not None else {}
    for name, data in beside.items():  # first: the file names them, or reads them by name
        if data.is_file():
            _partial_then_replace(out / name, partial(_copy, data))
    _partial_then_replace(path, artifact.copy_to)
    note_path = out / "model_shapes.txt"
    if artifact.note:
        note_path.write_text(artifact.note + "\n")
    elif note_path.exists():
        note_path.unlink()
    keep = {path.name, "model_shapes.txt", *beside}
    _remove(out, "model_state.pt", "model_state.txt", *(n for n in _MODELS if n not in keep))
    return {"model": path}


def _copy(src: Path, dest: Path) -> Path:
    return Path(shutil.copyfile(src, dest))


def load(directory: str | Path, compile: bool | None = None) -> nn.Module:
    """The model saved in `directory` (or a model.pt2 path), ready to run. `compile=None`
    follows the run (when a compiled variant won, as result.json's `deploy.compile` says:
    its AOTInductor package model_aoti.pt2 where the run wrote one, else model.pt2 through
    torch.compile; no compile without a result.json); True / False force torch.compile
    of model.pt2 on or off."""
    from opswap.backends import registry
    from opswap.backends.pt2 import load as load_program

    path = Path(directory)
    owner = registry.of_file(path)
    folder = path.parent if path.suffix == ".pt2" or owner is not None else path
    pt2 = path if path.suffix == ".pt2" else path / "model.pt2"
    if not pt2.is_file():
        # a runtime's file (model.onnx, model.xml, ...): the one named, else the one in DIR
        for rt in (owner,) if owner is not None else registry.runtimes():
            file = path if owner is not None else folder / rt.file
            if file.is_file():
                return rt.load(file)
    if not pt2.is_file():
        state = folder / "model_state.pt"
        if state.is_file():
            raise OpswapError(
                f"{folder} holds model_state.pt but no model.pt2 (the model did not export, "
                f"see model_state.txt); rebuild it with `opswap apply SPEC {folder}/plan.json`."
            )
        raise OpswapError(
            f"No saved model at {pt2}; `opswap optimize SPEC --out DIR` writes DIR/model.pt2."
        )
    result = folder / "result.json"
    package = pt2.with_name("model_aoti.pt2")
    if compile is None:
        compile = _compiled(result) if result.is_file() else False
        if compile and package.is_file():
            from opswap.backends import aoti

            ahead = aoti.load(package, pt2)  # compiled ahead of time: no compile here
            if ahead is not None:
                return ahead
    module = load_program(pt2)
    graphed = result.is_file() and _deploy_flag(result, "cuda_graph") and torch.cuda.is_available()
    if compile:
        from opswap.backends.int8_inductor import compile_module

        # as the race compiled it: static int8 sites through Inductor's int8 lowering, and
        # Inductor's CUDA graphs where the compiled winner replayed them
        return compile_module(module, cudagraphs=bool(graphed))
    if graphed:
        from opswap.backends.cudagraph import CudaGraphed

        return CudaGraphed(module)  # as the race timed it
    return module


_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def _deploy_flag(result: Path, key: str) -> bool:
    """result.json's `deploy.KEY` where it is true, else False (never raises)."""
    try:
        deploy = json.loads(result.read_text()).get("deploy")
    except Exception:
        return False
    return isinstance(deploy, dict) and deploy.get(key) is True


def _compiled(result: Path) -> bool:
    """Whether the run in result.json saved a compiled variant (its `deploy.compile`)."""
    try:
        data = json.loads(result.read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as e:
        raise OpswapError(f"{result} is not readable JSON ({e}); rerun opswap optimize.") from e

    def refuse(what: str) -> OpswapError:
        return OpswapError(
            f"{result} is not an opswap result ({what}); rerun opswap optimize, "
            f"or pass compile=True or False to load model.pt2 without it."
        )

    if not isinstance(data, dict):
        raise refuse(f"it holds {_JSON_TYPES.get(type(data), 'a value')}, not an object")
    deploy = data.get("deploy")
    if deploy is None:  # a result.json from before `deploy` was written
        return False
    if not isinstance(deploy, dict):
        raise refuse(f"its deploy is {_JSON_TYPES.get(type(deploy), 'a value')}, not an object")
    flag = deploy.get("compile", False)
    if not isinstance(flag, bool):
        raise refuse(f"its deploy.compile is {json.dumps(flag)}, not true or false")
    return flag


def file_claim(
    dynamic: Dynamic | None, artifact: Artifact | None, notes: list[str]
) -> Dynamic | None:
    """The axes the saved file keeps dynamic: `dynamic` less those torch.export specialised
    in `artifact`, with a note when it is narrower."""
    kept = artifact.kept if artifact is not None else None
    if dynamic is None or kept is None or len(kept.axes) >= len(dynamic.axes):
        return dynamic
    if artifact is not None and artifact.note and artifact.note not in notes:
        notes.append(artifact.note + " (the optimized module in memory takes them dynamic)")
    return kept


def write_run(out_dir: str | Path, write: Callable[[Path], dict[str, Path]]) -> dict[str, Path]:
    """Call `write(folder)` on a fresh temporary folder beside `out_dir`, then swap what it
    wrote into `out_dir`; returns `write`'s paths as they lie in `out_dir`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OpswapError(
            f"{out} is a file; save the run into a folder (a new or an earlier run's one)."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        paths = write(tmp)
        written = {p.name for p in tmp.iterdir()}
        out.mkdir(exist_ok=True)
        for name in RUN_FILES - written:
            stale = out / name
            if stale.is_file() or stale.is_symlink():
                stale.unlink()
        for name in sorted(written, key=lambda n: (n not in _FIRST, n in _LAST, n)):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {k: out / Path(v).name for k, v in paths.items()}


def _partial_then_replace(path: Path, write: Callable[[Path], object]) -> None:
    """`write(p)` into a file beside `path`, renamed to `path` once complete."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _remove(out: Path, *names: str) -> None:
    for name in names:
        (out / name).unlink(missing_ok=True)


def json_default(o: object) -> object:
    """How result.json writes a value JSON has no type for."""
    if isinstance(o, float | int):
        return o
    if isinstance(o, torch.dtype | Path):
        return str(o)
    return repr(o)


def _version() -> str:
    from opswap._version import __version__

    return __version__


def _totals(analysis: Analysis | None) -> dict[str, Any] | None:
    if analysis is None:
        return None
    return {
        "total_flops": analysis.total_flops,
        "total_bytes": analysis.total_bytes,
        "est_time_s": analysis.est_time_s,
        "ops": len(analysis.rows),
    }
