"""Chapter 21: ONNX-level rewrites. A tiny ViT, exported to ONNX as another tool would
hand it over, is planned with opswap's ONNX rules (sites and near misses), optimized
(verified in ONNX Runtime at batch 2, 1 and 3, then timed against the file as exported
and against ORT's own transformer optimizer in one interleaved loop) and saved.

    python examples/ch21_onnx_rewrites.py
"""

import json
import tempfile
from pathlib import Path

from opswap.onnx import load_onnx, optimize_onnx, plan_onnx, save_onnx
from opswap.onnx.hf_export import export_spec


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = export_spec("hf:vit", Path(tmp) / "vit.onnx", exporter="legacy")
        model = load_onnx(path)
        print(model.describe(), "sizes", model.sizes)

        plan, _ = plan_onnx(model)
        for rule, n in plan.counts().items():
            print(f"  {rule}: {n} site{'s' * (n != 1)}")
        for miss in plan.misses[:3]:
            print(f"  miss {miss.rule} at {miss.where}: {miss.reason}")

        result = optimize_onnx(model, model_type="vit", samples=1, min_time_s=0.3)
        paths = save_onnx(result, Path(tmp) / "out")
        data = json.loads(paths["result"].read_text())
        v = data["verification"]
        print(
            f"verified at {v['shapes']}: {'PASSED' if v['passed'] else 'FAILED'}, max_abs {v['max_abs']:.2g}"
        )
        print("ORT's optimizer fused:", {k: n for k, n in data["peer"]["fused"].items() if n})
        for x in data["variants"]:
            print(f"  {x['name']:<14} {x['ms']:.3f} ms  {x['speedup_vs_input']:.2f}x vs the export")
        print("saved:", data["best"], "->", paths["model"].name)


if __name__ == "__main__":
    main()
