"""opswap's int8 BERT against the runtimes' own int8 on the CPU, one interleaved run.

    PYTHONPATH=src python benchmarks/bench_int8_peers.py [--spec SPEC?k=v] [--out DIR]

The model (default BERT-base: `hf:bert` at full size, batch 1, sequence 128, random
weights) is exported to ONNX once (torch.onnx's dynamo exporter). Then one interleaved
loop times, each on the same inputs:

- `torch_fp32`: the model as given; `compile`: torch.compile of it;
- `torchao_pt2e_x86+compile`: torchao's PT2E static int8 with the x86 Inductor quantizer,
  calibrated on the same batches, compiled with Inductor's freezing;
- `opswap`: `opswap.optimize(..., exactness="approx")`'s saved model (its race decides
  what is saved, int8 where int8 measured faster here), reloaded from model.pt2 as
  `opswap.load_optimized` gives it (compiled when a compiled variant won;
  `opswap_uncompiled` beside it then), and
  `opswap_int8_static`: the model planned with `precision.int8_static_linear` for a
  profile where int8 pays, calibrated on 8 random batches (measured whatever this CPU's
  timing decides), and `opswap_int8_static_handoff`, the same plus
  `precision.int8_static_handoff` (uint8 from each up projection, its GELU in the
  epilogue, to the down projection);
- `ort_fp32`, `ort_fp32_transformer_optimizer` (the same file after ORT's own
  transformer optimizer, `model_type="bert"`) and `ort_int8_dynamic`
  (`onnxruntime.quantization.quantize_dynamic`, QInt8 weights), when onnxruntime is
  installed;
- `ort_opswap_int8` and `openvino_opswap_int8`: opswap's int8 plan with the handoffs
  exported to ONNX (QuantizeLinear / DequantizeLinear around the integer layers, its
  calibrated scales as constants) and run by each runtime: what opswap adds to the
  runtime, against the runtime on the input's export;
- `openvino_fp32` (inference precision f32 asked for), `openvino_default` (what the CPU
  plugin picks unasked: bfloat16 on a CPU with AVX-512 BF16) and `openvino_int8`
  (`nncf.quantize` on 8 calibration batches, default precision for what stays float),
  when openvino and nncf are installed; the JSON records each one's inference precision.

Each row: ms, speed-up over torch_fp32 with its 95% interval, and cosine / rel L2 of the
first output against torch_fp32's. Writes DIR/int8_peers_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _onnx(module, xs, path: Path) -> str | None:
    errors = []
    for dynamo in (True, False):  # the dynamo exporter needs onnxscript; else TorchScript's
        try:
            kw = {"external_data": False} if dynamo else {}
            torch.onnx.export(module, xs, str(path), dynamo=dynamo, **kw)
            return None
        except Exception as e:  # the exporter is the peers' entry: say why they are missing
            errors.append(f"dynamo={dynamo}: {type(e).__name__}: {str(e)[:160]}")
    return "ONNX export failed: " + "; ".join(errors)


def _ort(path: Path, tmp: Path, spec: tuple[str, dict] | None) -> tuple[dict, dict] | str:
    try:
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as e:
        return f"not installed: {e.name}"
    q = tmp / "int8.onnx"
    quantize_dynamic(str(path), str(q), weight_type=QuantType.QInt8)
    # the sessions opswap's own ORT variants get (ORT_ENABLE_ALL, torch's thread count, no
    # spinning threads to take the cores from the variant timed next)
    from opswap.backends.ort import session

    fns = {}
    files = [("ort_fp32", path), ("ort_int8_dynamic", q)]
    if spec is not None:
        try:  # the baseline: ORT after its own transformer optimizer, on the
            # legacy exporter's file (the one the optimizer is written for)
            import onnx

            from opswap.onnx.hf_export import export_spec
            from opswap.onnx.peer import ort_optimize

            name, sets = spec
            legacy = export_spec(name, tmp / "legacy.onnx", sets, exporter="legacy")
            best, _ = ort_optimize(onnx.load(str(legacy)), "bert")
            onnx.save(best, str(tmp / "ort_optimized.onnx"))
            files.append(("ort_fp32_transformer_optimizer", tmp / "ort_optimized.onnx"))
        except Exception as e:  # the peer's own failure: the others are still timed
            print(f"ORT's transformer optimizer failed: {type(e).__name__}: {e}", flush=True)
    for name, p in files:
        sess = session(p)
        inputs = [i.name for i in sess.get_inputs()]
        fns[name] = lambda *a, s=sess, n=inputs: torch.from_numpy(
            s.run(None, {k: v.numpy() for k, v in zip(n, a, strict=False)})[0]
        )
    return fns, {"onnxruntime": ort.__version__}


def _openvino(path: Path, calibration) -> tuple[dict, dict] | str:
    try:
        import nncf
        import openvino as ov
    except ImportError as e:
        return f"not installed: {e.name}"
    core = ov.Core()
    model = core.read_model(str(path))
    q = nncf.quantize(
        model,
        nncf.Dataset([tuple(t.numpy() for t in s) for s in calibration]),
        subset_size=len(calibration),
        model_type=nncf.ModelType.TRANSFORMER,
    )
    from _results import openvino_variants

    fns, precision = openvino_variants(core, model, q)
    return fns, {
        "openvino": ov.__version__,
        "nncf": nncf.__version__,
        "openvino_inference_precision": precision,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="hf:bert?size=full&batch=1&seq=128")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _results import compare_variants, pt2e_x86, write_results

    import opswap
    from opswap.bench.timing import describe_device
    from opswap.config import OptimizeConfig
    from opswap.graph.calibrate import Calibration, attach
    from opswap.graph.capture import capture
    from opswap.models import load
    from opswap.pipeline import optimize
    from opswap.planner import apply_plan, make_plan
    from opswap.targets.base import Target
    from opswap.verify.samples import make_samples

    name, _, rest = args.spec.partition("?")
    sets = dict(kv.split("=", 1) for kv in rest.split("&") if kv)
    m = load(name, overrides=sets)
    xs = m.example_inputs
    calibration = make_samples(xs, 8, seed=1)
    row: dict = {"model": args.spec, "inputs": [list(t.shape) for t in xs]}
    versions: dict = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        t0 = time.time()
        r = optimize(
            m.module, xs, OptimizeConfig(exactness="approx", samples=2, layers=False), name=name
        )
        r.save(tmp / "opswap")
        row["opswap"] = {
            "optimize_s": round(time.time() - t0, 1),
            "saved": r.best,
            "rules": sorted({d.rule for d in r.plan.decisions}),
            "skipped": [s.reason for s in r.plan.skipped][:5],
        }
        pays = Target(
            name="int8-pays",
            description="int8 at 4x float32, to build the int8 model",
            kind="cpu",
            peak_flops={"float32": 1e11, "int8": 4e11},
            mem_bandwidth=2e10,
            memory_bytes=2**34,
            dtypes=("float32", "int8"),
        )
        cap = capture(m.module, xs)
        attach(cap.gm, Calibration(calibration))
        plan = make_plan(
            cap, rules=["fusion.*", "precision.int8_static_linear"], exactness="approx", target=pays
        )
        row["int8_static_sites"] = sum(
            d.rule.endswith("int8_static_linear") for d in plan.decisions
        )
        # the same with uint8 handed from each up projection (its GELU in the epilogue)
        # to the down projection, timed beside it
        plan_h = make_plan(
            cap,
            rules=["fusion.*", "precision.int8_static_linear", "precision.int8_static_handoff"],
            exactness="approx",
            target=pays,
        )
        row["handoffs"] = sum(d.rule.endswith("int8_static_handoff") for d in plan_h.decisions)
        fns = {
            "torch_fp32": m.module,
            # the saved file as a user loads it: compiled when the race saved a compiled
            # variant, and the plain graph beside it
            "opswap": opswap.load_optimized(
                tmp / "opswap", compile=False if args.no_compile else None
            ),
            "opswap_int8_static": apply_plan(cap, plan).gm,
            "opswap_int8_static_handoff": apply_plan(cap, plan_h).gm,
        }
        # the runtimes on opswap's int8 export: the handoff plan's QDQ ONNX file (its
        # calibrated scales and uint8 handoffs written as QuantizeLinear/DequantizeLinear)
        # in ONNX Runtime and OpenVINO, against the same runtimes on the input's export
        from opswap.backends.openvino import openvino_artifact
        from opswap.backends.ort import ort_artifact

        for label, make in (
            ("ort_opswap_int8", ort_artifact),
            ("openvino_opswap_int8", openvino_artifact),
        ):
            (tmp / label).mkdir()
            art = make(fns["opswap_int8_static_handoff"], xs, None, tmp / label)
            if art.module is None:
                row[label] = art.error
            else:
                fns[label] = art.module
        if r.best.endswith("+compile") and not args.no_compile:
            fns["opswap_uncompiled"] = opswap.load_optimized(tmp / "opswap", compile=False)
        with torch.inference_mode():
            fns["opswap"](*xs)  # the compiled one's compilation, outside the timing
        if not args.no_compile:
            c = torch.compile(m.module)
            with torch.inference_mode():
                c(*xs)
            fns["compile"] = c
            # torchao's PT2E static int8 (x86 Inductor quantizer, compiled with freezing)
            pt2e = pt2e_x86(m.module, xs, calibration)
            if isinstance(pt2e, str):
                row["torchao_pt2e"] = pt2e
            else:
                fns["torchao_pt2e_x86+compile"] = pt2e
        onnx_path = tmp / "model.onnx"
        why = _onnx(m.module, xs, onnx_path)
        if why:
            row["onnx"] = why
        else:
            for label, got in (
                ("onnxruntime", _ort(onnx_path, tmp, (name, sets) if "bert" in name else None)),
                ("openvino", _openvino(onnx_path, calibration)),
            ):
                if isinstance(got, str):
                    row[label] = got
                else:
                    fns.update(got[0])
                    versions.update(got[1])
        variants = compare_variants(fns, xs, "torch_fp32")
    row["variants"] = variants
    by = {v["name"]: v["ms"] for v in variants}
    for engine, base in (
        ("ort", "ort_fp32"),
        ("ort", "ort_fp32_transformer_optimizer"),
        ("ort", "ort_int8_dynamic"),
        ("openvino", "openvino_default"),
        ("openvino", "openvino_int8"),
    ):
        mine = by.get(f"{engine}_opswap_int8")
        if mine and by.get(base):
            row[f"{engine}_opswap_int8_vs_{base}"] = by[base] / mine
    int8_peers = [
        v
        for v in variants
        if v["name"] in ("ort_int8_dynamic", "openvino_int8", "torchao_pt2e_x86+compile")
    ]
    ours = min((v for v in variants if v["name"].startswith("opswap")), key=lambda v: v["ms"])
    if int8_peers:
        peer = min(int8_peers, key=lambda v: v["ms"])
        row["strongest_int8_peer"] = peer["name"]
        row["ours_over_strongest_int8_peer"] = peer["ms"] / ours["ms"]
    print(json.dumps({v["name"]: round(v["ms"], 2) for v in variants}), flush=True)
    print(
        json.dumps(
            {k: row.get(k) for k in ("strongest_int8_peer", "ours_over_strongest_int8_peer")}
        )
    )
    write_results(args.out, "int8_peers_cpu.json", describe_device("cpu"), [row], **versions)


if __name__ == "__main__":
    main()
