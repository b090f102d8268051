"""Static int8 CNNs against float32, torch.compile and OpenVINO (float32 and NNCF int8),
one interleaved run per model.

    PYTHONPATH=src python benchmarks/bench_int8_static.py [--specs SPEC ...] [--out DIR]

For each spec: the model is captured, calibrated on `--calibration` batches (random
inputs like the example; the digits models use their training split), and planned with
`fusion.*` and `precision.int8_static_*` for a profile where int8 pays, so that the int8
model is built whatever this CPU's timing would decide (whether it pays here is what
this script measures). Then one interleaved loop (inference mode) times:

- `input`: the float32 model as given, and `compile`: torch.compile of it;
- `opswap_int8`: the planned graph with onednn's int8 convolutions, and
  `opswap_int8+compile`: its export compiled as the race compiles the saved file (the int8
  sites through Inductor's own int8 lowering, backends/int8_inductor.py); `opswap_int8_float_maps` (and `+compile`): the same plan without
  `precision.int8_static_handoff`, every convolution writing float32, to show what the
  uint8 handoff between convolutions adds;
- `ort_fp32` and `ort_opswap_int8`: ONNX Runtime on the input's float32 export and on
  opswap's int8 export (QDQ around each convolution, uint8 between handed-off ones);
- `torchao_pt2e_x86+compile`: torchao's PT2E static int8 with the x86 Inductor quantizer on
  the same calibration batches, compiled with Inductor's freezing (the flow its docs give
  for CPU inference);
- `openvino_fp32` (float32 asked for), `openvino_default` (the CPU plugin's own pick:
  bfloat16 on a CPU with AVX-512 BF16) and `openvino_int8` (nncf.quantize on the same
  calibration batches), when openvino and nncf are installed.

Each row: time, speed-up over the input with its 95% interval, output cosine and rel L2
against float32, and for task models top-1 accuracy. Writes DIR/int8_static_cpu.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
HANDOFF = "precision.int8_static_handoff"
SPECS = [
    "zoo:resnet?batch=8",
    "hf:resnet?depths=[3,4,6,3]&hidden_sizes=[256,512,1024,2048]&embedding_size=64"
    "&layer_type=bottleneck&image_size=224&batch=1",
]


def _split(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition("?")
    return name, dict(kv.split("=", 1) for kv in rest.split("&") if kv)


def _openvino(module, xs, calibration):
    """{name: compiled model} for float32 (asked for), OpenVINO's default precision for the
    float model (bfloat16 on CPUs with AVX-512 BF16) and NNCF's int8, with the versions and
    each one's inference precision; or a reason string."""
    try:
        import nncf
        import openvino as ov
    except ImportError as e:
        return f"not installed: {e.name}"
    core = ov.Core()
    ovm = ov.convert_model(module, example_input=xs if len(xs) > 1 else xs[0])
    data = nncf.Dataset([tuple(t.numpy() for t in s) for s in calibration])
    q = nncf.quantize(ovm, data, subset_size=len(calibration))
    from _results import openvino_variants

    fns, precision = openvino_variants(core, ovm, q)
    versions = {"openvino": ov.__version__, "nncf": nncf.__version__}
    return fns, versions | {"openvino_inference_precision": precision}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", nargs="*", default=SPECS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--calibration", type=int, default=8)
    ap.add_argument("--method", default="minmax")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _results import compare_variants, pt2e_x86, write_results

    from opswap.backends.int8_inductor import compile_module
    from opswap.bench.timing import describe_device
    from opswap.graph.calibrate import Calibration, attach
    from opswap.graph.capture import capture
    from opswap.kernels import int8_static
    from opswap.models import load
    from opswap.planner import apply_plan, make_plan
    from opswap.targets.base import Target
    from opswap.verify.samples import make_samples

    pays = Target(
        name="int8-pays",
        description="a profile where int8 runs at 4x float32, to build the int8 model",
        kind="cpu",
        peak_flops={"float32": 1e11, "int8": 4e11},
        mem_bandwidth=2e10,
        memory_bytes=2**34,
        dtypes=("float32", "int8"),
    )
    rows, versions = [], {}
    for spec in args.specs:
        name, sets = _split(spec)
        m = load(name, overrides=sets)
        xs = m.example_inputs
        task = getattr(m, "task", None)
        calibration = (
            list(task.calibration)[: args.calibration]
            if task is not None and getattr(task, "calibration", None)
            else make_samples(xs, args.calibration, seed=1)
        )
        row: dict = {"model": name, "set": sets, "inputs": [list(t.shape) for t in xs]}
        t0 = time.time()
        cap = capture(m.module, xs)
        attach(cap.gm, Calibration(calibration, method=args.method))
        plan = make_plan(
            cap, rules=["fusion.*", "precision.int8_static_*"], exactness="approx", target=pays
        )
        int8 = apply_plan(cap, plan).gm
        row["plan_s"] = round(time.time() - t0, 1)
        rules = [d.rule for d in plan.decisions]
        row["int8_sites"] = sum(
            r.startswith("precision.int8_static") and r != HANDOFF for r in rules
        )
        row["handoffs"] = rules.count(HANDOFF)
        row["kernels"] = int8_static.describe()
        fns = {"input": m.module, "opswap_int8": int8}
        if row["handoffs"]:
            # the same plan without the uint8 handoffs, timed in the same run: what they add
            plain = copy.copy(plan)
            plain.decisions = [d for d in plan.decisions if d.rule != HANDOFF]
            fns["opswap_int8_float_maps"] = apply_plan(cap, plain).gm
        # ONNX Runtime on the input's float32 export and on opswap's int8 export (its
        # convolutions as QDQ around Conv, the handoffs as uint8 values between them)
        try:
            from opswap.backends.ort import ort_artifact

            for label, mod in (("ort_fp32", m.module), ("ort_opswap_int8", int8)):
                art = ort_artifact(mod, xs, None, tempfile.mkdtemp(prefix=f"{label}-"))
                if art.module is None:
                    row[label] = art.error
                else:
                    fns[label] = art.module
        except ImportError as e:
            row["onnxruntime"] = f"not installed: {e.name}"
        ov = _openvino(m.module, xs, calibration)
        if isinstance(ov, str):
            row["openvino"] = ov
        else:
            ov_fns, versions = ov
            row["openvino_inference_precision"] = versions.pop("openvino_inference_precision")
            fns.update(ov_fns)
        if not args.no_compile:
            pt2e = pt2e_x86(m.module, xs, calibration)
            if isinstance(pt2e, str):
                row["torchao_pt2e"] = pt2e
            else:
                fns["torchao_pt2e_x86+compile"] = pt2e
            for base in [k for k in ("input", "opswap_int8", "opswap_int8_float_maps") if k in fns]:
                if base == "input":
                    c = torch.compile(fns[base])
                else:  # as the race compiles the saved file: Inductor's int8 lowering
                    c = compile_module(torch.export.export(fns[base], tuple(xs)).module())
                with torch.inference_mode():
                    c(*xs)
                fns["compile" if base == "input" else f"{base}+compile"] = c
        variants = compare_variants(
            fns,
            xs,
            "input",
            extra=(lambda k, f, t=task: {"accuracy": t.evaluate(f)}) if task is not None else None,
        )
        row["variants"] = variants
        ours = min((v for v in variants if v["name"].startswith("opswap")), key=lambda v: v["ms"])
        peers = [v for v in variants if not v["name"].startswith(("opswap", "input"))]
        peer = min(peers, key=lambda v: v["ms"]) if peers else None
        row["strongest_peer"] = peer["name"] if peer else None
        row["ours_over_strongest_peer"] = peer["ms"] / ours["ms"] if peer else None
        rows.append(row)
        print(
            json.dumps(
                {
                    "model": name,
                    "int8_sites": row["int8_sites"],
                    "ms": {v["name"]: round(v["ms"], 2) for v in variants},
                    "cosine": {v["name"]: round(v["cosine"], 5) for v in variants},
                    "vs_peer": row["ours_over_strongest_peer"],
                }
            ),
            flush=True,
        )
    write_results(
        args.out,
        "int8_static_cpu.json",
        describe_device("cpu"),
        rows,
        method=args.method,
        calibration_batches=args.calibration,
        **versions,
    )


if __name__ == "__main__":
    main()
