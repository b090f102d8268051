"""The race at the end of the flow: every way the user could run the model, verified and
timed in one interleaved loop.

A speed-up against eager alone hides the question a user asks: "is this faster than
what I would do anyway?" So the candidates are

- `input`: the model as given (the yardstick: speed-ups are against it);
- `captured`: the input exported to model.pt2 and reloaded, with no rewrite (shows what
  the saved form itself costs, and is what is saved when the input wins);
- `opswap`: the optimized candidate, exported to model.pt2 and reloaded: the file the
  user gets is the one timed (backends.pt2);
- with `compare=["compile"]`: `compile` (torch.compile of the input, the one line a user
  would try first) and `opswap+compile` (torch.compile of the reloaded candidate, which
  is what a user does with the file);
- with `compare=["ort"]` (or an ONNX export asked for): `ort` and `opswap+ort`, the
  input's and the candidate's programs as .onnx files run in ONNX Runtime
  (bench.runtimes);
- with `compare=["openvino"]`: `openvino` and `opswap+openvino`, the same programs as
  .onnx files compiled by OpenVINO for the CPU (bench.runtimes);
- with `compare=["executorch"]`: `executorch` and `opswap+executorch`, the same programs
  as .pte files with the XNNPACK delegate in ExecuTorch's runtime (bench.runtimes);
- with `compare=["tvm"]`: `tvm` and `opswap+tvm`, the same programs compiled by Apache
  TVM for this CPU and run by Relax's VM (bench.runtimes).

A model that does not export is timed in memory instead, and the variant's note says
that the file cannot hold it.

Each is verified against the input before it may win, and all are timed in the same
`benchmark` call, so drift and neighbours hit them alike. The saved result is the
fastest verified variant; when nothing opswap made beats the input, the result is the
input unchanged. A runtime (ONNX Runtime, OpenVINO, ...) is one more builder here, as
bench.runtimes is for ONNX Runtime.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from opswap.bench.accuracy import REFERENCE, judged_by
from opswap.errors import OpswapError
from opswap.graph.inputs import caller, fresh


def baselines() -> tuple[str, ...]:
    """What --compare takes: compile, and every runtime's name (backends.registry)."""
    from opswap.backends import registry

    return ("compile", *registry.names())


@dataclass
class Variant:
    """One way to run the model. `saves` says what the saved artifact is when it wins:
    the input's graph or the candidate's, and whether it is to be compiled."""

    name: str
    fn: Callable | None
    saves: str  # "input" or "candidate"
    compiled: bool = False
    artifact: Any = None  # backends.pt2.Artifact whose reloaded module `fn` is
    compile_s: float | None = None
    verified: bool | None = None
    reasons: list[str] = field(default_factory=list)
    note: str = ""
    shapes: list[str] = field(default_factory=list)  # the input shapes it was verified at
    #: the verification it was judged by, summed up (bench.accuracy.judged_by)
    accuracy: dict[str, Any] | None = None


@dataclass
class VariantTiming:
    """A variant's place in the race: its median and spread, and its speed-up over the
    input as the ratio of the medians (so it agrees with the times printed beside it),
    with its 95% bootstrap interval (and the per-round ratios' quartiles)."""

    name: str
    ms: float | None
    iqr_ms: float | None
    speedup_vs_input: float | None
    ratio_q1: float | None
    ratio_q3: float | None
    verified: bool
    compile_s: float | None = None
    note: str = ""
    ci_low: float | None = None  # 95% bootstrap interval of speedup_vs_input
    ci_high: float | None = None
    settled: bool | None = None  # the interval narrowed to the race's rel_width in time
    reasons: list[str] = field(default_factory=list)  # why it was not verified (or raced)
    #: the verification it was judged by (bench.accuracy.judged_by), with the task's metric
    #: where the run had a task; None where it could not be run at all
    accuracy: dict[str, Any] | None = None

    @property
    def within_noise(self) -> bool:
        """True when the interval holds 1.0: neither faster nor slower than the input."""
        if self.ci_low is None or self.ci_high is None or math.isnan(self.ci_low):
            return True
        return self.ci_low <= 1.0 <= self.ci_high

    @property
    def faster(self) -> bool:
        """Faster than the input beyond the noise of the run."""
        return self.ci_low is not None and not math.isnan(self.ci_low) and self.ci_low > 1.0

    @property
    def slower(self) -> bool:
        """Slower than the input beyond the noise of the run."""
        return self.ci_high is not None and not math.isnan(self.ci_high) and self.ci_high < 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ms": self.ms,
            "iqr_ms": self.iqr_ms,
            "speedup_vs_input": self.speedup_vs_input,
            "speedup_ci": [self.ci_low, self.ci_high],
            "speedup_quartiles": [self.ratio_q1, self.ratio_q3],
            "within_noise": self.within_noise,
            "settled": self.settled,
            "verified": self.verified,
            "compile_s": self.compile_s,
            "note": self.note,
            "reasons": list(self.reasons),
            "accuracy": self.accuracy,
        }


def parse_compare(compare) -> list[str]:
    """The baselines a `--compare` setting asks for: "compile" (default), "ort", "openvino",
    "executorch", "tvm", "none",
    or a list / comma-separated string of baseline names."""
    if compare is None:
        return ["compile"]
    items = [
        c.strip().lower()
        for c in (compare.split(",") if isinstance(compare, str) else compare)
        if str(c).strip()
    ]
    if items in ([], ["none"]):
        return []
    known = baselines()
    bad = [c for c in items if c not in known]
    if bad:
        raise OpswapError(
            f"Unknown baseline {bad[0]!r} for --compare; use {', '.join(known)} or none."
        )
    return list(dict.fromkeys(items))


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot run here, or None. On CPU Inductor writes C++ and needs a
    compiler on the PATH."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler on the PATH, which torch.compile's CPU backend needs"
    return None


def _compiled(name: str, module, inputs: tuple, saves: str, cudagraphs: bool = False) -> Variant:
    """torch.compile of `module`, compiled now (first call timed as its compile time); its
    static int8 sites through Inductor's own int8 lowering (backends.int8_inductor);
    `cudagraphs`: replayed from CUDA graphs (torch.compile's mode="reduce-overhead")."""
    from opswap.backends.int8_inductor import compile_module

    try:
        fn = compile_module(module, cudagraphs=cudagraphs)
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn(*fresh(inputs))
        return Variant(name, fn, saves, compiled=True, compile_s=time.perf_counter() - t0)
    except Exception as e:  # a model Dynamo or Inductor cannot take: the race goes on
        from opswap.backends.dynamo import compile_failure

        why = f"torch.compile failed: {compile_failure(e)}"  # torch's own words, op included
        return Variant(name, None, saves, compiled=True, verified=False, reasons=[why], note=why)


def _graphed(module, inputs: tuple) -> Variant:
    """opswap's graph (the reloaded model.pt2) replayed from a CUDA graph captured at the
    example's shapes (backends.cudagraph), or why it cannot be captured."""
    from opswap.backends.cudagraph import CudaGraphed

    name = "opswap+cudagraph"
    try:
        fn = CudaGraphed(module)
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn.capture(*fresh(inputs))
        return Variant(
            name,
            fn,
            "candidate",
            compiled=True,
            compile_s=time.perf_counter() - t0,
            note="opswap's model.pt2 replayed from a CUDA graph at the example's shapes",
        )
    except Exception as e:  # a forward that syncs with the host cannot be captured
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        why = f"CUDA graph capture failed: {type(e).__name__}: {first}"
        return Variant(
            name, None, "candidate", compiled=True, verified=False, reasons=[why], note=why
        )


def _saved_form(artifact, in_memory) -> tuple[Any, str, Any]:
    """The module a saved-graph variant times: the artifact reloaded from its file, or the
    in-memory graph when the file could not be written, with a note saying so."""
    if artifact is not None and artifact.ok:
        note = "reloaded from model.pt2"
        if artifact.note:
            note += "; accepts the example's shapes only"
        return artifact.module, note, artifact
    why = artifact.error if artifact is not None else "not exported"
    return in_memory, f"timed in memory: model.pt2 cannot hold it ({why})", None


def build(
    model,
    captured_gm,
    candidate_gm,
    inputs: tuple,
    compare: list[str],
    device: torch.device,
    artifacts: dict[str, Any] | None = None,
) -> list[Variant]:
    """The variants of one run. `model` is opswap's private copy of the input; compiled
    variants compile private copies, so the models timed elsewhere stay eager.
    `artifacts` maps "input" and "candidate" to their backends.pt2.Artifact."""
    from opswap.graph.copies import private_copy

    artifacts = artifacts or {}
    cap_fn, cap_note, cap_art = _saved_form(artifacts.get("input"), captured_gm)
    opt_fn, opt_note, opt_art = _saved_form(artifacts.get("candidate"), candidate_gm)
    out = [
        Variant("input", model, "input", verified=True, accuracy=dict(REFERENCE)),
        Variant("captured", cap_fn, "input", note=cap_note, artifact=cap_art),
        Variant("opswap", opt_fn, "candidate", note=opt_note, artifact=opt_art),
    ]
    if "compile" in compare:
        why = compile_unavailable(device)
        if why is not None:
            out += [
                Variant(n, None, s, compiled=True, verified=False, reasons=[why], note=why)
                for n, s in (("compile", "input"), ("opswap+compile", "candidate"))
            ]
        else:
            out.append(_compiled("compile", private_copy(model), inputs, "input"))
            out.append(_compiled("opswap+compile", private_copy(opt_fn), inputs, "candidate"))
    if device.type == "cuda":  # opswap's graph replayed from a CUDA graph: no host overhead
        out.append(_graphed(opt_fn, inputs))
        if "compile" in compare:  # and the peer a user would reach for against it
            out.append(_compiled("compile+cudagraph", private_copy(model), inputs, "input", True))
            out.append(
                _compiled(
                    "opswap+compile+cudagraph", private_copy(opt_fn), inputs, "candidate", True
                )
            )
    from opswap.backends import registry
    from opswap.bench.runtimes import describe

    for rt in (r for r in registry.runtimes() if r.name in compare):
        for name in rt.variants:  # the engines over their files
            art = artifacts.get(rt.key(name))
            saves = "candidate" if name.startswith("opswap+") else "input"
            note, why = describe(art, rt)
            if why is not None:
                out.append(Variant(name, None, saves, verified=False, reasons=[why], note=note))
            else:
                out.append(Variant(name, cast(Any, art).module, saves, note=note, artifact=art))
    return out


def _judged(check) -> dict[str, Any] | None:
    """bench.accuracy.judged_by of a verification (None for a stand-in without outputs)."""
    return judged_by(check) if hasattr(check, "outputs") else None


def _static_fallback(v: Variant, source, inputs: tuple, verify_fn, artifacts: dict, key: str):
    """When the file a saved-graph variant times failed verification at sizes other than
    the example's (a bf16 convolution stack whose GPU algorithms change with the batch),
    its file exported again with every size static, verified at the example's and, when
    it passes, put in the variant's place (and `artifacts[key]`'s) with a note that says
    why: the run saves what it could verify, never the input while a verified variant is
    faster."""
    from opswap.backends.pt2 import export_artifact

    art = v.artifact
    if art is None or art.kept is None or not art.kept.axes:
        return  # it claimed only the example's sizes: nothing narrower to try
    why = "; ".join(v.reasons)[:300] or "failed"
    static = export_artifact(source, inputs, None)
    if not static.ok:
        return
    check = verify_fn(static.module, shapes=False)
    if not check.passed:
        v.reasons.append(f"exported with static sizes, it fails too: {'; '.join(check.reasons)}")
        return
    static.note = (
        "model.pt2 keeps every input size at the example's: with "
        f"{', '.join(a.name for a in art.kept.axes)} dynamic it failed verification ({why})"
    )
    v.fn, v.artifact, v.verified, v.reasons = static.module, static, True, []
    v.shapes = list(getattr(check, "shapes", []) or [])
    v.accuracy = _judged(check)
    v.note = f"reloaded from model.pt2; {static.note}"
    artifacts[key] = static


def race(
    variants: list[Variant],
    inputs: tuple,
    device: torch.device,
    *,
    min_time_s: float = 0.5,
    max_time_s: float = 8.0,
    rel_width: float = 0.1,
    copy: bool = False,
):
    """Time every verified variant in one interleaved loop (inference mode; buffers put
    back afterwards), for at least `min_time_s` and, on a noisy machine, until every
    speed-up's 95% interval is narrower than `rel_width` of it or `max_time_s` passed.
    Unverified variants are listed without a time. A variant whose interval is still wider
    than `rel_width` when time runs out is `settled=False`. Returns the timings and the raw
    bench.stats.BenchResult."""
    from opswap.bench.stats import narrow
    from opswap.bench.timing import benchmark
    from opswap.graph.copies import preserved_state

    runnable = [v for v in variants if v.fn is not None and v.verified]
    fns = {v.name: caller(cast(Callable, v.fn), inputs, copy) for v in runnable}
    mods = [v.fn for v in runnable]
    with torch.inference_mode(), preserved_state(*mods):
        res = benchmark(
            fns,
            warmup=3,
            repeats=15,
            min_time_s=min_time_s,
            max_time_s=max_time_s,
            rel_width=rel_width,
            device=device,
        )
    base = res["input"].median
    out = []
    for v in variants:
        if v.name not in fns:
            out.append(
                VariantTiming(
                    v.name,
                    None,
                    None,
                    None,
                    None,
                    None,
                    False,
                    v.compile_s,
                    v.note,
                    reasons=list(v.reasons) or [v.note or "not verified"],
                    accuracy=v.accuracy,
                )
            )
            continue
        s = res[v.name]
        r = res.ratio("input", v.name)
        settled = (
            True if v.name == "input" else narrow(r.ci_low, r.ci_high, r.of_medians, rel_width)
        )
        out.append(
            VariantTiming(
                v.name,
                s.median * 1e3,
                s.iqr * 1e3,
                base / s.median,
                r.q1,
                r.q3,
                True,
                v.compile_s,
                v.note,
                r.ci_low,
                r.ci_high,
                settled,
                accuracy=v.accuracy,
            )
        )
    return out, res


def model_bench(
    res,
    variants: list[Variant],
    inputs: tuple,
    device: torch.device,
    opt: str = "opswap",
    copy: bool = False,
):
    """The input-against-candidate figures (result.json's `benchmark`) read off the race,
    so that they are the race's own numbers, with each model's peak memory over one call
    measured after the timing."""
    from opswap.bench.memory import peak_memory
    from opswap.bench.stats import ModelBench, narrow
    from opswap.graph.copies import preserved_state

    if opt not in res.stats:
        return None
    r = res.ratio("input", opt)
    by = {v.name: v for v in variants}
    notes, peaks = [], {}
    with torch.inference_mode(), preserved_state(by["input"].fn, by[opt].fn):
        for name in ("input", opt):
            try:
                fn = cast(Callable, by[name].fn)  # raced, so it has a function
                peaks[name] = peak_memory(caller(fn, inputs, copy), device=device).peak_bytes
            except Exception as e:  # memory is a bonus; the timing stands without it
                notes.append(f"peak memory not measured: {type(e).__name__}: {str(e)[:120]}")
                break
    settled = (
        None if res.rel_width is None else narrow(r.ci_low, r.ci_high, r.of_medians, res.rel_width)
    )
    return ModelBench.of(
        res,
        "input",
        opt,
        ref_peak=peaks.get("input"),
        opt_peak=peaks.get(opt),
        notes=notes,
        rel_width=res.rel_width,
        settled=settled,
    )


# A variant whose interval did not narrow in time must beat the input by this much at the
# interval's lower end to be saved: on a busy machine a lower end just above 1 is luck.
UNSETTLED_MARGIN = 1.05

# The variant whose verification covers the file a winner saves: a compiled winner saves
# the plain export it compiles, and `input` saves the input's export; a runtime's variant
# (backends.registry) saves its own file, which it was verified as.
FILE_OF = {
    "input": "captured",
    "captured": "captured",
    "compile": "captured",
    "opswap": "opswap",
    "opswap+compile": "opswap",
    "opswap+cudagraph": "opswap",
    "compile+cudagraph": "captured",
    "opswap+compile+cudagraph": "opswap",
}


def best(timings: list[VariantTiming], files_ok: set[str] | None = None) -> VariantTiming:
    """The fastest verified variant whose saved file passed verification at every shape it
    claims (`files_ok`: the variants whose file did; None: all); the input unless
    something is faster than it beyond the noise of the run (the lower end of its
    speed-up's interval above 1).

    When the race did not settle (some interval still wide when time ran out), the choice
    is conservative: a variant must clear UNSETTLED_MARGIN at its interval's lower end, and
    the highest lower end wins, not the lowest median."""
    by = {t.name: t for t in timings}
    # a timing that is faster has its ms and ci_low (the casts below)
    faster = [
        t
        for t in timings
        if t.verified
        and t.name != "input"
        and t.ms is not None
        and (files_ok is None or t.name in files_ok)
        and t.faster
        and (t.settled is not False or cast(float, t.ci_low) > UNSETTLED_MARGIN)
    ]
    if not faster:
        return by["input"]
    if any(t.settled is False for t in timings if t.ms is not None):
        return max(faster, key=lambda t: cast(float, t.ci_low))
    return min(faster, key=lambda t: cast(float, t.ms))


def saved_verification(variants: list[Variant]) -> dict[str, dict[str, Any] | None]:
    """Per variant, the verification the file it saves passed: {"variant", "shapes"}, or None
    when that file's variant was not verified or failed. A saved-graph variant is verified
    at every shape its file claims (the example's only where the file accepts no other), so
    its pass covers the file; a compiled variant's own check (at the example's shape) does
    not, and it leans on the plain variant it compiles."""
    by = {v.name: v for v in variants}
    out: dict[str, dict[str, Any] | None] = {}
    for v in variants:
        f = by.get(FILE_OF.get(v.name, v.name))
        out[v.name] = (
            {"variant": f.name, "shapes": list(f.shapes)} if f is not None and f.verified else None
        )
    return out


@dataclass
class Race:
    """One optimize run's race: the timings, the winner, the files timed ("input",
    "candidate": backends.pt2.Artifact) and the input-against-opswap figures."""

    timings: list[VariantTiming]
    winner: VariantTiming
    artifacts: dict[str, Any]
    benchmark: Any  # bench.stats.ModelBench, or None when opswap's variant was not timed
    # the verification the saved file passed ({"variant", "shapes"}), None when it passed none
    verified_as: dict[str, Any] | None = None
    result: Any = None  # the raw bench.stats.BenchResult of the race
    settled: bool | None = None  # every interval narrowed in time
    notes: list[str] = field(default_factory=list)
    #: per variant, the verification its saved file passed (saved_verification)
    files: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    #: the variants raced (their callables: the task's metric is taken on them afterwards)
    variants: list[Variant] = field(default_factory=list)


def run(
    model,
    captured,
    candidate_gm,
    verify_fn,
    *,
    compare: list[str],
    device,
    export: str | None = None,
) -> Race:
    """Export, build, verify and race the variants of one optimize run. `verify_fn(fn,
    shapes)` verifies a callable against the input at the example and at every size of
    `shapes` (a graph.dynamic.Dynamic: the capture's, or the axes a saved file keeps),
    or at the example's only when `shapes` is False (compiled variants would recompile
    for each new shape). `export` "onnx" or "ort" races the ONNX Runtime variants and
    saves the faster of the two .onnx files ("openvino": the two OpenVINO IRs,
    "executorch": the two .pte files; bench.runtimes.export_winner)."""
    from opswap.backends import registry
    from opswap.backends.pt2 import export_artifact
    from opswap.bench import runtimes
    from opswap.bench.device import resolve_device
    from opswap.graph.copies import preserved_state

    dev = resolve_device(device)
    inputs = captured.example_inputs
    saving = registry.for_export(export) if export is not None else None
    engine = saving.name if saving is not None else None
    if engine is not None and engine not in compare:
        compare = [*compare, engine]
    engines = tuple(e for e in registry.names() if e in compare)
    keep = bool(engines)  # the programs, for the runtimes' files
    with preserved_state(model, candidate_gm):
        artifacts = {
            "input": export_artifact(model, inputs, captured.dynamic, keep_program=keep),
            "candidate": export_artifact(candidate_gm, inputs, captured.dynamic, keep_program=keep),
        }
        if keep:
            runtimes.exports(artifacts, inputs, captured.dynamic, dev, engines, export=export)
    variants = build(model, captured.gm, candidate_gm, inputs, compare, dev, artifacts)
    for v in variants:
        if v.verified is not None:
            continue
        # a compiled variant would recompile at each new shape; a file at the sizes it keeps
        shapes = (
            False
            if v.compiled
            else v.artifact.kept
            if v.artifact is not None and v.artifact.kept is not None
            else captured.dynamic
        )
        check = verify_fn(v.fn, shapes=shapes)
        v.verified, v.reasons = check.passed, list(check.reasons)
        v.shapes = list(getattr(check, "shapes", []) or [])
        v.accuracy = _judged(check)
        if v.compiled and v.compile_s is not None:
            done = "captured" if v.name == "opswap+cudagraph" else "compiled"
            v.note = f"{done} in {v.compile_s:.1f} s; verified at the example's shape"
    sources = {"captured": ("input", model), "opswap": ("candidate", candidate_gm)}
    for v in variants:
        if v.name in sources and v.verified is False:
            key, source = sources[v.name]
            with preserved_state(model, candidate_gm):
                _static_fallback(v, source, inputs, verify_fn, artifacts, key)
    copy = bool(getattr(captured, "writes_inputs", None))  # a forward that writes into them
    timings, res = race(variants, inputs, dev, copy=copy)
    files = saved_verification(variants)
    ok = {n for n, f in files.items() if f is not None}
    winner = best(timings, ok)
    notes = runtimes.added(timings, ok, res, engine)
    if saving is not None and engine is not None:
        chosen = runtimes.export_winner(timings, ok, res, engine)
        if chosen is not None:
            winner = chosen
        else:
            said = "; ".join(t.note for t in timings if t.name in saving.variants)
            kind = saving.saves.split(" ", 1)[1]  # ".onnx file", ...
            notes.append(
                f"--export {export}: no {kind} passed verification ({said}), "
                f"so the run saves {winner.name}'s file instead."
            )
    return Race(
        timings,
        winner,
        artifacts,
        model_bench(res, variants, inputs, dev, copy=copy),
        verified_as=files.get(winner.name),
        result=res,
        settled=all(t.settled is not False for t in timings),
        notes=notes,
        files=files,
        variants=variants,
    )
