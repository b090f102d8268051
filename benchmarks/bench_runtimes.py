"""PyTorch against the runtimes (ONNX Runtime, OpenVINO, ExecuTorch), and each runtime on
the input's export against the same runtime on opswap's.

    PYTHONPATH=src python benchmarks/bench_runtimes.py [--models bert,resnet50]
        [--engines ort,openvino,executorch] [--out DIR]

Models, float32, random weights, batch 1: BERT-base (`hf:bert` at full size, sequence
128; `bert_sdpa` the same calling scaled_dot_product_attention), ResNet-50
(`hf:resnet` at full size: Hugging Face's ResNetConfig defaults are ResNet-50's
bottleneck stages, 224 x 224; torchvision is not needed) and, with `--models vit_sdpa`,
ViT-base/16 at 224 (`--models gpt2_sdpa`: GPT-2 at sequence 128) calling
scaled_dot_product_attention. One interleaved
loop per model times, on the same inputs:

- `eager`: the model as given; `compile`: torch.compile of it;
- `ort_input`: the input's program exported to ONNX (torch.onnx's dynamo exporter,
  dynamic as opswap's capture claims) and run in ONNX Runtime (CPU, ORT_ENABLE_ALL),
  what a user would do without opswap;
- `ort_opswap`: opswap's candidate with exact rules (the plan opswap makes for this
  CPU), exported with its ops lowered and onnxscript's ORT fusions, run the same way;
- `openvino_input` / `openvino_opswap`: the same two programs as .onnx files without
  ORT's fusions, compiled by OpenVINO for the CPU (f32, latency hint);
- `executorch_input` / `executorch_opswap`: the same two programs lowered to ExecuTorch
  programs with the XNNPACK delegate; the input's with ExecuTorch's own lowering, opswap's
  as `--export executorch` makes it (without the rules it leaves out for XNNPACK, and
  with attention written out for XNNPACK).

Each row: ms, speed-up over eager with its 95% interval, and cosine / rel L2 of the
first output against eager's. `ENGINE_opswap_vs_ENGINE_input` is the ratio of those two
medians in the same run, and `best_peer` the fastest variant that is not opswap's.
Writes DIR/runtimes_cpu.json.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

MODELS = {
    "bert": ("hf:bert", {"size": "full", "batch": "1", "seq": "128"}),
    "resnet50": ("hf:resnet", {"size": "full", "batch": "1"}),
    # the same BERT calling scaled_dot_product_attention (transformers' default), which
    # ExecuTorch's own lowering leaves mostly to its portable kernels
    "bert_sdpa": (
        "hf:bert",
        {"size": "full", "batch": "1", "seq": "128", "attn_implementation": "sdpa"},
    ),
    # ViT-base/16 at 224 x 224, the same way
    "vit_sdpa": ("hf:vit", {"size": "full", "batch": "1", "attn_implementation": "sdpa"}),
    # GPT-2 (124M) at sequence 128, the same way
    "gpt2_sdpa": (
        "hf:gpt2",
        {"size": "full", "batch": "1", "seq": "128", "attn_implementation": "sdpa"},
    ),
}


def _one(key: str, min_time_s: float, engines: list[str]) -> dict:
    import time

    from _results import compare_variants

    from opswap import api
    from opswap.backends import registry
    from opswap.backends.pt2 import export
    from opswap.planner import apply_plan

    spec, sets = MODELS[key]
    loaded = api.load(spec, **sets)
    model, inputs = api.keyword_call(loaded.module, loaded.example_inputs)
    captured = api.capture(model, inputs)
    xs = captured.example_inputs
    plan = api.plan(model, inputs)  # exact rules, this CPU's profile
    gm = apply_plan(captured, plan).gm
    programs = {}
    for src, module in (("input", model), ("opswap", gm)):
        with torch.no_grad():
            programs[src] = export(module, xs, captured.dynamic)
    # what --export executorch plans: without the rules it leaves out for XNNPACK
    left_out = registry.get("executorch").left_out
    kept = [d for d in plan.decisions if left_out is None or d.rule not in left_out[0]]
    if "executorch" in engines and len(kept) < len(plan.decisions):
        et_plan = copy.copy(plan)
        et_plan.decisions = kept
        with torch.no_grad():
            et_gm = apply_plan(captured, et_plan).gm
            programs["opswap_executorch"] = export(et_gm, xs, captured.dynamic)
    fns = {"eager": model, "compile": torch.compile(model)}
    build_s, failed = {}, {}
    for engine in engines:
        for src in ("input", "opswap"):
            name = f"{engine}_{src}"
            t0 = time.perf_counter()
            program = programs[src]
            if engine == "executorch" and src == "opswap":
                program = programs.get("opswap_executorch", program)
            art = registry.get(engine).build(
                None, xs, captured.dynamic, exported=program, mine=src == "opswap"
            )
            build_s[name] = round(time.perf_counter() - t0, 1)
            if art.module is None:
                failed[name] = art.error
                print(f"{key}: {name} failed: {art.error}", flush=True)
            else:
                fns[name] = art.module
    rows = compare_variants(fns, xs, "eager", min_time_s=min_time_s)
    by = {r["name"]: r for r in rows}
    peers = [r for r in rows if not r["name"].endswith("_opswap")]
    out = {
        "model": key,
        "spec": spec,
        "settings": sets,
        "applied": sorted({d.rule for d in plan.decisions}),
        "build_s": build_s,
        "failed": failed,
        "best_peer": min(peers, key=lambda r: r["ms"])["name"],
        "variants": rows,
    }
    for engine in engines:
        a, b = by.get(f"{engine}_input"), by.get(f"{engine}_opswap")
        if a is not None and b is not None:
            out[f"{engine}_opswap_vs_{engine}_input"] = a["ms"] / b["ms"]
    return out


def main() -> None:
    import onnxruntime
    import onnxscript
    from _results import write_results

    from opswap.bench.timing import describe_device

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bert,resnet50,bert_sdpa")
    ap.add_argument("--engines", default="ort,openvino,executorch")
    ap.add_argument("--min-time", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    rows = []
    engines = [e for e in args.engines.split(",") if e]
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for mod in ("openvino", "executorch"):
        try:
            versions[mod] = metadata.version(mod)
        except metadata.PackageNotFoundError:
            versions[mod] = None
    for key in args.models.split(","):
        row = _one(key, args.min_time, engines)
        rows.append(row)
        for v in row["variants"]:
            print(f"{key:9s} {v['name']:18s} {v['ms']:9.3f} ms  {v['speedup_vs_eager']:.2f}x")
        for k, v in row.items():
            if k.endswith("_input") and "_vs_" in k:
                print(f"{key:9s} {k}: {v:.2f}x")
    write_results(
        args.out,
        "runtimes_cpu.json",
        describe_device("cpu"),
        rows,
        threads=torch.get_num_threads(),
        onnxruntime=onnxruntime.__version__,
        onnxscript=onnxscript.__version__,
        **versions,
    )


if __name__ == "__main__":
    main()
