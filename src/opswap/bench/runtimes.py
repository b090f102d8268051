"""The runtime variants of the race: two per engine of backends.registry (a file of the
input's program and one of opswap's), built, described and judged here for every engine alike.

- `ort`: the input's program exported to ONNX and run in ONNX Runtime: what a user who
  deploys on ORT would do without opswap (the peer opswap's export must beat);
- `opswap+ort`: opswap's candidate exported to ONNX (its ops through backends.lowerings,
  and onnxscript's ORT fusions on the ONNX graph) and run in ONNX Runtime;
- `openvino` and `opswap+openvino` (with `--compare openvino`): the same two programs
  exported to ONNX without ORT's fusions (contrib ops OpenVINO does not read) and
  compiled by OpenVINO for the CPU (backends.openvino); with `--export openvino` the
  .onnx files are converted to OpenVINO's IR (model.xml + model.bin) first, and the IR
  is what is compiled, timed and saved;
- `executorch` and `opswap+executorch` (with `--compare executorch`): the same two
  programs lowered to ExecuTorch programs (.pte files) with the XNNPACK delegate and run
  in ExecuTorch's runtime (backends.executorch), the edge path;
- `tvm` and `opswap+tvm` (with `--compare tvm`): the same two programs imported into
  Apache TVM's Relax, compiled for this CPU into a shared library (model.so, TVM's
  default schedules unless tuned) and run by Relax's VM (backends.tvm).

Each file translates the very program model.pt2 holds (the exported program is
kept, not traced again), so it keeps the same dynamic axes (a .pte file up to an upper
bound per axis, since ExecuTorch plans memory ahead), and the session timed is the
session over the file that is saved when it wins (DIR/model.onnx, DIR/model.xml,
DIR/model.pte or DIR/model.so). They are
verified against the input at every size the file keeps, like the saved-graph
variants, before they may win.

With `--export onnx` (or `ort`) the user deploys an .onnx file whatever else wins (with
`--export openvino` an OpenVINO IR, with `--export executorch` a .pte file), so
`export_winner` picks between that engine's two variants: opswap's when it is faster
than the input's file beyond the run's noise, else the input's.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from opswap.backends import registry


def missing(export: str) -> str | None:
    """One sentence when a module the --export format `export` needs is not installed,
    else None."""
    return cast(registry.Runtime, registry.for_export(export)).missing(f"--export {export}")


def exports(
    artifacts: dict[str, Any],
    inputs: tuple,
    dynamic,
    device: torch.device,
    engines: tuple[str, ...] = ("ort",),
    *,
    export: str | None = None,
) -> None:
    """Add the files of `engines` (registry names; loaded in the engine) to `artifacts`, from
    the programs kept in its "input" and "candidate" backends.pt2.Artifacts, which are then
    let go. `export`: the run's --export format; the engine it saves writes that form (for
    OpenVINO its IR, model.xml, not an .onnx file)."""
    from opswap.backends.pt2 import Artifact

    runtimes = [registry.get(e) for e in engines]
    if device.type != "cpu":
        for rt in runtimes:
            why = f"{rt.runs} here, and the race is on {device}"
            for variant in rt.variants:
                artifacts[rt.key(variant)] = Artifact(None, None, error=why)
        return
    for src in ("input", "candidate"):
        pt2 = artifacts.get(src)
        exported = getattr(pt2, "exported", None)
        for rt in runtimes:
            key = f"{rt.name}_{src}"
            if exported is None:
                why = getattr(pt2, "error", None) or "not exported"
                artifacts[key] = Artifact(None, None, error=f"no program to translate ({why})")
            else:
                artifacts[key] = rt.build(
                    None,
                    inputs,
                    dynamic,
                    exported=exported,
                    mine=src == "candidate",
                    export=export in rt.exports,
                )
        if pt2 is not None:
            cast(Any, pt2).exported = None  # the program's weights: not held past the translation


def describe(art, rt: registry.Runtime) -> tuple[str, str | None]:
    """(the note of `rt`'s variant, why it cannot run or None) for its Artifact."""
    if art is None or art.module is None:
        why = art.error if art is not None else "not exported"
        return why[:200], why
    file = art.path.name if art.path is not None else "model.onnx"
    note = f"{file} in {rt.title} (CPU, {art.module.session_threads} threads)"
    return (note + "; " + art.note if art.note else note), None


def added(timings: list, files_ok: set[str], res, saved: str | None = None) -> list[str]:
    """What opswap adds to each runtime of the race, one sentence per engine whose two
    files both passed and were timed: opswap's file against your model's file in the same
    runtime, with the run's interval (and, for the engine `saved` by --export, when
    opswap's is not faster beyond the noise, that your model's file is the one saved)."""
    by = {t.name: t for t in timings}
    out = []
    for rt in registry.runtimes():
        engine, mine = rt.variants
        names = rt.variants
        if not all(n in by and by[n].verified and by[n].ms and n in files_ok for n in names):
            continue
        r = res.ratio(engine, mine)
        said = f"{rt.title}, opswap's file against your model's file: {r.describe()}"
        if not r.ci_low > 1.0:  # within the noise (describe says so), slower, or no interval
            said += ", slower" if r.ci_high < 1.0 else ""
            if engine == saved:
                said += f", so --export saves your model's file ({engine})"
        out.append(said + ".")
    return out


def export_winner(timings: list, files_ok: set[str], res, engine: str = "ort") -> Any:
    """The variant saved with --export for `engine`: `opswap+ENGINE` when it passed and is
    faster than `ENGINE` beyond the noise of the run (its interval of the ratio above 1),
    else `ENGINE`; None when neither passed."""
    by = {t.name: t for t in timings}
    mine = f"opswap+{engine}"
    ok = [
        n
        for n in registry.get(engine).variants
        if n in by and by[n].verified and by[n].ms is not None and n in files_ok
    ]
    if not ok:
        return None
    if ok == [mine]:
        return by[mine]
    if mine in ok:
        r = res.ratio(engine, mine)
        if r.ci_low is not None and cast(float, r.ci_low) > 1.0:
            return by[mine]
    return by[engine]
