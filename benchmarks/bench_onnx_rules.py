"""opswap's ONNX rules against ONNX Runtime's transformer optimizer, on the CPU.

    PYTHONPATH=src python benchmarks/bench_onnx_rules.py [--models bert,gpt2,vit] [--out DIR]

BERT-base, GPT-2 (small) and ViT-base, each built from its default config with random
weights (`hf:MODEL --set size=full`), batch 1, sequence 128 (ViT: 224 x 224), exported to
ONNX with torch's legacy (TorchScript) exporter, the one ORT's optimizer is written for,
batch and sequence symbolic. Then, for each model, one interleaved loop
(bench.timing.benchmark) times in ONNX Runtime, with its graph optimizations on:

- `input`: the exported file as it is;
- `ort-optimizer`: `onnxruntime.transformers.optimizer.optimize_model(model_type=...)`;
- `opswap`: the file after opswap's ONNX rules (opswap.onnx.plan_onnx).

Each row: ms and IQR of each, the speed-ups over the input and opswap over the
optimizer with their 95% intervals, both rewrites verified against the input (ORT,
optimizations off) at the example sizes and two others, ORT's fused-operator counts and
opswap's count of the same kinds. Writes DIR/onnx_rules_cpu.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    "bert": ("hf:bert", {"size": "full", "batch": 1, "seq": 128}, 12, 768),
    "gpt2": ("hf:gpt2", {"size": "full", "batch": 1, "seq": 128}, 12, 768),
    "vit": ("hf:vit", {"size": "full", "batch": 1, "image_size": 224}, 12, 768),
}


def run(kind: str, tmp: Path, min_time_s: float, threads: int) -> dict:
    import onnx

    from opswap.onnx.hf_export import export_spec
    from opswap.onnx.load import load_onnx, other_sizes
    from opswap.onnx.peer import covers, op_counts, ort_optimize
    from opswap.onnx.plan import plan_onnx
    from opswap.onnx.runtime import time_models, verify

    spec, sets, heads, hidden = MODELS[kind]
    t0 = time.perf_counter()
    path = export_spec(spec, tmp / f"{kind}.onnx", sets, exporter="legacy")
    export_s = time.perf_counter() - t0
    sizes = {"batch": 1, "sequence": 128} if kind != "vit" else {"batch": 1}
    m = load_onnx(path, sizes)
    t0 = time.perf_counter()
    plan, ours = plan_onnx(m)
    opswap_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs, stats = ort_optimize(onnx.load(str(path)), kind, num_heads=heads, hidden_size=hidden)
    ort_s = time.perf_counter() - t0
    at = [m.sizes, *other_sizes(m)]
    v_ours = verify(m, ours, at, "exact", 1)
    v_theirs = verify(m, theirs, at, "exact", 1)
    res = time_models(
        {"input": m.proto, "ort-optimizer": theirs, "opswap": ours},
        m,
        m.sizes,
        min_time_s=min_time_s,
        max_time_s=4 * min_time_s,
        threads=threads,
    )

    def ratio(a: str, b: str) -> dict:
        r = res.ratio(a, b)
        return {"x": r.of_medians, "ci": [r.ci_low, r.ci_high], "text": r.describe()}

    row = {
        "model": kind,
        "spec": spec,
        "sets": sets,
        "sizes": m.sizes,
        "export_s": export_s,
        "rewrite_s": {"opswap": opswap_s, "ort-optimizer": ort_s},
        "ms": {n: res[n].median_ms for n in ("input", "ort-optimizer", "opswap")},
        "iqr_ms": {n: res[n].iqr * 1e3 for n in ("input", "ort-optimizer", "opswap")},
        "speedup_vs_input": {
            "ort-optimizer": ratio("input", "ort-optimizer"),
            "opswap": ratio("input", "opswap"),
        },
        "opswap_vs_ort_optimizer": ratio("ort-optimizer", "opswap"),
        "rounds": len(res.rounds),
        "verified": {"opswap": v_ours.to_json(), "ort-optimizer": v_theirs.to_json()},
        "ort_fused": {k: v for k, v in stats.items() if v},
        "opswap_sites": plan.counts(),
        "coverage": {
            k: {"opswap": a, "ort": b} for k, (a, b) in covers(op_counts(ours), stats).items()
        },
        "device": res.device,
    }
    print(
        f"{kind}: input {row['ms']['input']:.2f} ms, ort-optimizer {row['ms']['ort-optimizer']:.2f} ms "
        f"({row['speedup_vs_input']['ort-optimizer']['text']}), opswap {row['ms']['opswap']:.2f} ms "
        f"({row['speedup_vs_input']['opswap']['text']}); opswap vs optimizer "
        f"{row['opswap_vs_ort_optimizer']['text']}; verified {v_ours.passed}/{v_theirs.passed}; "
        f"coverage {row['coverage']}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,gpt2,vit")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--min-time", type=float, default=10.0, help="seconds of timing per model")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="ORT intra-op threads (0: its default); 1 on a machine shared with other work",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import onnx
    import onnxruntime
    import onnxscript
    import transformers
    from _results import write_results

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            rows.append(run(kind.strip(), Path(tmp), args.min_time, args.threads))
    write_results(
        args.out,
        "onnx_rules_cpu.json",
        rows[0]["device"] if rows else "cpu",
        rows,
        onnx=onnx.__version__,
        onnxruntime=onnxruntime.__version__,
        onnxscript=onnxscript.__version__,
        transformers=transformers.__version__,
        exporter="torch.onnx.export(dynamo=False), opset 17",
        threads=args.threads or "ONNX Runtime's default (all cores)",
    )


if __name__ == "__main__":
    main()
