"""Top-1 accuracy of every precision scheme on a real task: the digits models of the zoo.

    PYTHONPATH=src python benchmarks/bench_digits_accuracy.py [--out DIR] [--models NAME ...]

For zoo:digits_mlp and zoo:digits_cnn, the float32 model and each rule of family
`precision` alone (found in opswap.rules.registry, so a scheme added later appears here
without an edit), planned with exactness lossy and applied at every site the plan takes
(no verification, no rollback: the scheme's own accuracy); static schemes calibrate on
the task's 8 training batches, min-max ranges, as `opswap optimize` does by default. Each row keeps its plan, so
that tests/models/test_digits.py applies the same sites again and checks the figures. Each row gives the top-1 on
the 360 held-out images, the change in points, the cosine and relative L2 of the logits
against float32's over the same images, and the sites taken.

A scheme is planned for this machine first (its timed `cpu` target). Where that plans no
site and the rule skipped some as predicted slower, it is planned for roofline profiles
instead, the first that takes a site: `cpu-int8x4` (this CPU's measured float32 rate and
bandwidth with int8 at 4x the float32 rate, what VNNI or AMX CPUs reach, and no per-op
dispatch cost; this AVX2 machine runs int8 GEMMs slower than float32), then the datasheet targets of
opswap.targets. The row says which target it was planned for. Accuracy is measured here,
on the CPU, whatever the target; a scheme whose kernels do not run here is listed as not
measured, with the reason. Writes DIR/digits_accuracy.json with the device, the versions
and the date, and prints the table in Markdown (docs/chapters/06-low-precision.md holds it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["zoo:digits_mlp", "zoo:digits_cnn"]


def _int8x4(cpu: Any) -> Any:
    """This CPU's measured float32 rate and bandwidth with int8 at 4x the float32 rate and
    no per-op dispatch cost, and no timer: the rules estimate with the roofline alone
    instead of timing here (a batch of 32 digits is too small to amortise dispatch)."""
    peak = dict(cpu.peak_flops)
    peak["int8"] = 4 * peak["float32"]
    return dataclasses.replace(
        cpu,
        name="cpu-int8x4",
        description=(
            "this CPU's float32 rate and bandwidth, int8 at 4x float32, "
            "no per-op dispatch cost (roofline only)"
        ),
        peak_flops=peak,
        dispatch_s=0.0,
        view_dispatch_s=0.0,
        timer=None,
    )


def _targets() -> list[Any]:
    """Where a scheme is planned, in order: this machine (timed), then roofline profiles."""
    from opswap.bench.timing import with_timer
    from opswap.targets import get_target, list_targets

    cpu = get_target("cpu")
    return [with_timer(cpu), _int8x4(cpu)] + [get_target(n) for n in list_targets() if n != "cpu"]


def _plan_somewhere(captured: Any, rule: str) -> tuple[Any, Any, str]:
    """(plan, target, why) for `rule` alone: on this machine, else on the first roofline
    target where it takes a site; `why` says why this machine did not take it."""
    from opswap.planner import make_plan

    targets = _targets()
    here = make_plan(captured, target=targets[0], rules=[rule], exactness="lossy")
    slower = [s for s in here.skipped if s.reason.startswith("predicted slower")]
    if here.decisions or not slower:
        return here, targets[0], ""
    for target in targets[1:]:
        plan = make_plan(captured, target=target, rules=[rule], exactness="lossy")
        if plan.decisions:
            return plan, target, f"{len(slower)} site(s) predicted slower on this machine"
    return here, targets[0], f"{len(slower)} site(s) predicted slower on every target"


def _logits(fn: Any, x: torch.Tensor, batch: int) -> torch.Tensor:
    """`fn` over `x` in batches of exactly `batch` rows (the last one padded), as the
    task runs it; float32 logits [N, 10]."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(x), batch):
            rows = torch.arange(start, start + batch) % len(x)
            out.append(fn(x[rows])[: min(batch, len(x) - start)].float())
    return torch.cat(out)


def _row(spec: str, loaded: Any, scheme: str, fn: Any, ref: torch.Tensor, x: torch.Tensor) -> dict:
    from opswap.verify.metrics import compare

    batch = loaded.example_inputs[0].shape[0]
    logits = _logits(fn, x, batch)
    m = compare(ref, logits)
    return {
        "model": spec,
        "scheme": scheme,
        "top1": loaded.task.evaluate(fn),
        "cosine": m.cosine,
        "rel_l2": m.rel_l2,
    }


def calibrated(loaded: Any) -> Any:
    """The capture of `loaded`, with its task's calibration batches (from the training
    split) attached for the static schemes, as `opswap optimize` attaches them."""
    from opswap.graph.calibrate import Calibration, attach
    from opswap.graph.capture import capture

    captured = capture(loaded.module, loaded.example_inputs)
    attach(captured.gm, Calibration(list(loaded.task.calibration), source="training batches"))
    return captured


def measure(spec: str) -> list[dict]:
    """The float row and one row per precision rule for `spec`."""
    from opswap.models import load
    from opswap.planner import apply_plan
    from opswap.rules import registry

    loaded = load(spec)
    shape = loaded.example_inputs[0].shape[1:]
    from opswap.models.zoo_digits import digits

    x = digits(spec).test_x.view(-1, *shape)
    batch = loaded.example_inputs[0].shape[0]
    ref = _logits(loaded.module, x, batch)
    rows = [
        {
            **_row(spec, loaded, "float32", loaded.module, ref, x),
            "sites": 0,
            "skipped": [],
            "target": "-",
            "note": "",
        }
    ]
    captured = calibrated(loaded)
    for rule in [r.name for r in registry.all_rules() if r.family == "precision"]:
        plan, target, why = _plan_somewhere(captured, rule)
        base = {
            "model": spec,
            "scheme": rule,
            "sites": len(plan.decisions),
            "skipped": [s.reason for s in plan.skipped],
            "target": target.name,
            "plan": plan.to_json(),  # what tests/models/test_digits.py applies again
        }
        misses = sorted({m.reason for m in plan.misses})
        skipped = f"{len(plan.skipped)} skipped on {target.name}" if plan.skipped else ""
        note = "; ".join(filter(None, [why, skipped, *misses[:2]]))
        try:
            gm = apply_plan(captured, plan).gm
            rows.append({**_row(spec, loaded, rule, gm, ref, x), **base, "note": note})
        except Exception as e:  # a kernel that does not run on this machine
            rows.append(
                {**base, "top1": None, "cosine": None, "rel_l2": None, "note": f"not measured: {e}"}
            )
    return rows


def table(rows: list[dict]) -> str:
    """The rows as the Markdown table the chapter page holds."""
    lines = [
        "| model | scheme | planned for | sites | top-1 | change (points) | cosine | rel L2 |",
        "|---|---|---|--:|--:|--:|--:|--:|",
    ]
    floats = {r["model"]: r["top1"] for r in rows if r["scheme"] == "float32"}
    for r in rows:
        if r["top1"] is None:
            lines.append(
                f"| {r['model']} | {r['scheme']} | {r['target']} | {r['sites']} | "
                "not measured | | | |"
            )
            continue
        change = 100 * (r["top1"] - floats[r["model"]])
        lines.append(
            f"| {r['model']} | {r['scheme']} | {r['target']} | {r['sites']} | "
            f"{r['top1']:.4f} | {change:+.2f} | {r['cosine']:.6f} | {r['rel_l2']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--models", nargs="*", default=MODELS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sklearn
    from _results import write_results

    from opswap.bench.timing import describe_device

    rows = [r for spec in args.models for r in measure(spec)]
    targets = {t.name: t.description for t in _targets()}
    write_results(
        args.out,
        "digits_accuracy.json",
        describe_device("cpu"),
        rows,
        sklearn=sklearn.__version__,
        threads=torch.get_num_threads(),
        targets={r["target"]: targets[r["target"]] for r in rows if r["target"] in targets},
    )
    print(table(rows))
    for r in rows:
        if r["note"]:
            print(f"- {r['model']} {r['scheme']}: {r['note']}")


if __name__ == "__main__":
    main()
