"""opswap's int8 BERT-base against OpenVINO with NNCF's int8 on the CPU (issue 37).

    PYTHONPATH=src:NNCF_DEPS python benchmarks/bench_int8_nncf.py [--runs 3] [--threads N]

The model is bench_int8_peers's (`hf:bert` at full size, batch 1, sequence 128, random
weights), calibrated on the same 8 random batches for both. opswap's int8 model is the
plan bench_int8_peers saves when int8 pays (attention.sdpa, layout.*, fusion.*,
precision.int8_static_linear and precision.int8_static_handoff), exported to model.pt2,
reloaded and compiled through Inductor's int8 lowering (backends.int8_inductor):

- `opswap_int8_before`: as that lowering compiled it before this benchmark existed
  (float32 flash attention, Python wrapper);
- `opswap_int8`: `compile_module`'s defaults (attention in bfloat16 where the CPU has it,
  C++ wrapper);
- `openvino_nncf_int8`: `nncf.quantize(..., model_type=TRANSFORMER)` of the ONNX export,
  compiled by OpenVINO's CPU plugin at its default precision, with the same thread count.

`--runs` interleaved comparisons (each one `compare_variants`: medians with IQR, cosine
against float32), each followed by a loop that reads the process's CPU time per call
(the machine is shared: wall time counts the time other processes hold the cores, CPU
time much less so). Then the time split per op kind: each kind's total per forward, the
smallest over `--profile-iters` forwards, from torch's profiler for opswap's Python-wrapper
model and from OpenVINO's per-layer counters (PERF_COUNT) for NNCF's. Writes
OUT/int8_nncf_cpu.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _cpu_times(fns: dict, inputs: tuple, rounds: int) -> dict:
    """Median and smallest process CPU time and wall time per call, interleaved."""
    cpu: dict = {k: [] for k in fns}
    wall: dict = {k: [] for k in fns}
    with torch.inference_mode():
        for _ in range(rounds):
            for k, f in fns.items():
                c, t = time.process_time(), time.perf_counter()
                f(*inputs)
                wall[k].append(time.perf_counter() - t)
                cpu[k].append(time.process_time() - c)
    return {
        k: {
            "cpu_ms": statistics.median(cpu[k]) * 1e3,
            "cpu_min_ms": min(cpu[k]) * 1e3,
            "wall_ms": statistics.median(wall[k]) * 1e3,
            "wall_min_ms": min(wall[k]) * 1e3,
        }
        for k in fns
    }


def _kind_ours(name: str) -> str | None:
    n = name.lower()
    if "qlinear" in n:
        return "int8 GEMM"
    if "scaled_dot_product" in n or n in ("aten::bmm", "aten::mm", "aten::matmul"):
        return "attention matmuls"
    if "cpp_fused" in n:
        for word, kind in (
            ("layer_norm", "layer norm (+add, quantize)"),
            ("softmax", "softmax (+scale, mask, casts)"),
            ("gelu", "GELU"),
            ("quantize", "quantize / casts / permutes"),
        ):
            if word in n:
                return kind
        return "other fused loops"
    if n.startswith("aten::"):
        return "aten views and allocations"
    if "compiledfxgraph" in n or "dynamo" in n or "torch-compiled" in n:
        return "wrapper and guards (self time)"
    return None


def _profile_ours(fn, inputs: tuple, iters: int) -> dict:
    """ms per op kind (self time), the smallest over `iters` forwards."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with torch.inference_mode():
        fn(*inputs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(iters):
                with record_function(f"iter{i}"):
                    fn(*inputs)
    per: dict = collections.defaultdict(lambda: collections.Counter())
    for e in prof.events():
        it = None
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("iter"):
                it = parent.name
            parent = parent.cpu_parent
        kind = _kind_ours(e.name)
        if it is not None and kind is not None:
            per[kind][it] += e.self_cpu_time_total / 1e3
    return {k: round(min(v.values()), 3) for k, v in sorted(per.items())}


def _profile_openvino(req, feeds: list, iters: int) -> dict:
    """ms per (layer type, kernel) from OpenVINO's per-layer counters, smallest over `iters`."""
    per: dict = collections.defaultdict(list)
    for _ in range(iters):
        req.infer(feeds)
        got: collections.Counter = collections.Counter()
        for p in req.get_profiling_info():
            if p.status == p.Status.EXECUTED:
                got[f"{p.node_type} [{p.exec_type}]"] += p.real_time.total_seconds() * 1e3
        for k, v in got.items():
            per[k].append(v)
    return {k: round(min(v), 3) for k, v in sorted(per.items(), key=lambda kv: -min(kv[1]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="hf:bert?size=full&batch=1&seq=128")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=20, help="CPU-time rounds per run")
    ap.add_argument("--profile-iters", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import nncf
    import openvino as ov
    from _results import compare_variants, write_results

    from opswap.backends import pt2
    from opswap.backends.int8_inductor import compile_module, native_bf16
    from opswap.bench.timing import describe_device
    from opswap.graph.calibrate import Calibration, attach
    from opswap.graph.capture import capture
    from opswap.models import load
    from opswap.planner import apply_plan, make_plan
    from opswap.targets.base import Target
    from opswap.verify.samples import make_samples

    name, _, rest = args.spec.partition("?")
    sets = dict(kv.split("=", 1) for kv in rest.split("&") if kv)
    m = load(name, overrides=sets)
    xs = m.example_inputs
    calibration = make_samples(xs, 8, seed=1)
    pays = Target(
        name="int8-pays",
        description="int8 at 4x float32, to build the int8 model",
        kind="cpu",
        peak_flops={"float32": 1e11, "int8": 4e11},
        mem_bandwidth=2e10,
        memory_bytes=2**34,
        dtypes=("float32", "int8"),
    )
    rules = [
        "attention.sdpa",
        "layout.*",
        "fusion.*",
        "precision.int8_static_linear",
        "precision.int8_static_handoff",
    ]
    row: dict = {"model": args.spec, "inputs": [list(t.shape) for t in xs], "rules": rules}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        cap = capture(m.module, xs)
        attach(cap.gm, Calibration(calibration))
        plan = make_plan(cap, rules=rules, exactness="approx", target=pays)
        row["int8_static_sites"] = sum(
            d.rule.endswith("int8_static_linear") for d in plan.decisions
        )
        row["handoffs"] = sum(d.rule.endswith("int8_static_handoff") for d in plan.decisions)
        ep = pt2.export(apply_plan(cap, plan).gm, xs)[0]
        torch.export.save(ep, str(tmp / "model.pt2"))
        program = pt2.load(tmp / "model.pt2")
        ours = compile_module(program)
        before = compile_module(program, bf16_attention=False, cpp_wrapper=False)
        row["bf16_attention"] = native_bf16()
        with torch.inference_mode():
            for f in (ours, before):
                t0 = time.perf_counter()
                f(*xs)
                row.setdefault("compile_s", []).append(round(time.perf_counter() - t0, 1))
        torch.onnx.export(m.module, xs, str(tmp / "m.onnx"), dynamo=True, external_data=False)
        core = ov.Core()
        q = nncf.quantize(
            core.read_model(str(tmp / "m.onnx")),
            nncf.Dataset([tuple(t.numpy() for t in s) for s in calibration]),
            subset_size=len(calibration),
            model_type=nncf.ModelType.TRANSFORMER,
        )
        config = {"INFERENCE_NUM_THREADS": args.threads}
        compiled = core.compile_model(q, "CPU", config)
        row["openvino_inference_precision"] = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
        row["fake_quantize_nodes"] = sum(op.get_type_name() == "FakeQuantize" for op in q.get_ops())

        def nncf_int8(*a: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(compiled(tuple(t.numpy() for t in a))[0])

        fns = {
            "torch_fp32": m.module,
            "opswap_int8_before": before,
            "opswap_int8": ours,
            "openvino_nncf_int8": nncf_int8,
        }
        runs = []
        for i in range(args.runs):
            load_before = os.getloadavg()
            variants = compare_variants(fns, xs, "torch_fp32", min_time_s=3.0, max_time_s=20.0)
            cpu = _cpu_times(fns, xs, args.rounds)
            by = {v["name"]: v for v in variants}
            for k, v in cpu.items():
                by[k].update({kk: round(vv, 3) for kk, vv in v.items()})
            run = {
                "loadavg_1_5_15": [round(x, 2) for x in load_before],
                "variants": variants,
                "nncf_over_ours_wall": by["openvino_nncf_int8"]["ms"] / by["opswap_int8"]["ms"],
                "nncf_over_ours_cpu": by["openvino_nncf_int8"]["cpu_ms"]
                / by["opswap_int8"]["cpu_ms"],
                "nncf_over_before_wall": by["openvino_nncf_int8"]["ms"]
                / by["opswap_int8_before"]["ms"],
                "nncf_over_before_cpu": by["openvino_nncf_int8"]["cpu_ms"]
                / by["opswap_int8_before"]["cpu_ms"],
            }
            runs.append(run)
            print(
                f"run {i}: load {run['loadavg_1_5_15']}",
                {k: (round(v["ms"], 2), round(v["cpu_ms"], 2)) for k, v in by.items()},
                {k: round(v, 3) for k, v in run.items() if k.startswith("nncf")},
                flush=True,
            )
        row["runs"] = runs
        for key in ("nncf_over_ours_wall", "nncf_over_ours_cpu", "nncf_over_before_wall",
                    "nncf_over_before_cpu"):  # fmt: skip
            vals = [r[key] for r in runs]
            row[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # Inductor's loops named in the profile
        profiled = {"opswap_int8_before": compile_module(
            program, bf16_attention=False, cpp_wrapper=False
        ), "opswap_int8_python_wrapper": compile_module(program, cpp_wrapper=False)}  # fmt: skip
        row["split_ms"] = {k: _profile_ours(f, xs, args.profile_iters) for k, f in profiled.items()}
        req = core.compile_model(q, "CPU", {**config, "PERF_COUNT": True}).create_infer_request()
        row["split_ms"]["openvino_nncf_int8"] = _profile_openvino(
            req, [t.numpy() for t in xs], args.profile_iters
        )
        print(json.dumps(row["split_ms"], indent=1), flush=True)
    write_results(
        args.out,
        "int8_nncf_cpu.json",
        describe_device("cpu"),
        [row],
        threads=args.threads,
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        openvino=ov.__version__,
        nncf=nncf.__version__,
    )


if __name__ == "__main__":
    main()
