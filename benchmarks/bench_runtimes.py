"""PyTorch against ONNX Runtime, and ORT on the input's export against ORT on opswap's.

    PYTHONPATH=src python benchmarks/bench_runtimes.py [--models bert,resnet50] [--out DIR]

Models, float32, random weights, batch 1: BERT-base (`hf:bert` at full size, sequence
128) and ResNet-50 (`hf:resnet` at full size: Hugging Face's ResNetConfig defaults are
ResNet-50's bottleneck stages, 224 x 224; torchvision is not needed). One interleaved
loop per model times, on the same inputs:

- `eager`: the model as given; `compile`: torch.compile of it;
- `ort_input`: the input's program exported to ONNX (torch.onnx's dynamo exporter,
  dynamic as opswap's capture claims) and run in ONNX Runtime (CPU, ORT_ENABLE_ALL),
  what a user would do without opswap;
- `ort_opswap`: opswap's candidate with exact rules (the plan opswap makes for this
  CPU), exported with its ops lowered and onnxscript's ORT fusions, run the same way.

Each row: ms, speed-up over eager with its 95% interval, and cosine / rel L2 of the
first output against eager's. `ort_opswap_vs_ort_input` is the ratio of those two
medians in the same run. Writes DIR/runtimes_cpu.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

MODELS = {
    "bert": ("hf:bert", {"size": "full", "batch": "1", "seq": "128"}),
    "resnet50": ("hf:resnet", {"size": "full", "batch": "1"}),
}


def _one(key: str, min_time_s: float) -> dict:
    from _results import compare_variants

    from opswap import api
    from opswap.backends.ort import ort_artifact
    from opswap.backends.pt2 import export
    from opswap.planner import apply_plan

    spec, sets = MODELS[key]
    loaded = api.load(spec, **sets)
    model, inputs = api.keyword_call(loaded.module, loaded.example_inputs)
    captured = api.capture(model, inputs)
    xs = captured.example_inputs
    plan = api.plan(model, inputs)  # exact rules, this CPU's profile
    gm = apply_plan(captured, plan).gm
    arts = {}
    for name, module, fusions in (("ort_input", model, False), ("ort_opswap", gm, True)):
        with torch.no_grad():
            exported = export(module, xs, captured.dynamic)
        arts[name] = ort_artifact(None, xs, captured.dynamic, exported=exported, fusions=fusions)
        if arts[name].module is None:
            raise SystemExit(f"{key}: {name} failed: {arts[name].error}")
    fns = {
        "eager": model,
        "compile": torch.compile(model),
        "ort_input": arts["ort_input"].module,
        "ort_opswap": arts["ort_opswap"].module,
    }
    rows = compare_variants(fns, xs, "eager", min_time_s=min_time_s)
    by = {r["name"]: r for r in rows}
    return {
        "model": key,
        "spec": spec,
        "settings": sets,
        "applied": sorted({d.rule for d in plan.decisions}),
        "ort_opswap_vs_ort_input": by["ort_input"]["ms"] / by["ort_opswap"]["ms"],
        "variants": rows,
    }


def main() -> None:
    import onnxruntime
    import onnxscript
    from _results import write_results

    from opswap.bench.timing import describe_device

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bert,resnet50")
    ap.add_argument("--min-time", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    rows = []
    for key in args.models.split(","):
        row = _one(key, args.min_time)
        rows.append(row)
        for v in row["variants"]:
            print(f"{key:9s} {v['name']:11s} {v['ms']:9.3f} ms  {v['speedup_vs_eager']:.2f}x")
        print(f"{key:9s} ort_opswap / ort_input: {row['ort_opswap_vs_ort_input']:.2f}x")
    write_results(
        args.out,
        "runtimes_cpu.json",
        describe_device("cpu"),
        rows,
        threads=torch.get_num_threads(),
        onnxruntime=onnxruntime.__version__,
        onnxscript=onnxscript.__version__,
    )


if __name__ == "__main__":
    main()
