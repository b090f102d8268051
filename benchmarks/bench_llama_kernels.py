"""End to end on the GPU: a Llama-style decoder (hf:llama from a config, random weights)
in bfloat16 through `opswap optimize` with the Triton row-kernel rules (norm.*,
activation.*) beside the exact fusion and layout rules, raced against torch.compile.

    PYTHONPATH=src python3 benchmarks/bench_llama_kernels.py --out DIR

The figure that counts is `opswap+compile` against `compile` in the same race (issue 18:
at least as fast). Writes DIR/llama_kernels_<card>.json (h100 or h200) with the device, versions and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card  # noqa: E402

CONFIG = {
    "hidden_size": "2048",
    "intermediate_size": "5632",
    "num_hidden_layers": "4",
    "num_attention_heads": "32",
    "num_key_value_heads": "4",
    "vocab_size": "32000",
    "max_position_embeddings": "1024",
    "batch": "8",
    "seq": "512",
}


def run() -> dict:
    import triton

    from opswap.config import OptimizeConfig
    from opswap.models import load
    from opswap.pipeline import optimize

    res: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(0),
        "model": "hf:llama",
        "config": CONFIG,
        "dtype": "bfloat16",
    }
    try:
        m = load("hf:llama", CONFIG)
        module = m.module.to("cuda", torch.bfloat16)
        inputs = tuple(
            x.to("cuda", torch.bfloat16) if x.is_floating_point() else x.to("cuda")
            for x in m.example_inputs
        )
        r = optimize(
            module,
            inputs,
            OptimizeConfig(target="h200", device="cuda", layers=False, measure_rules=False),
            name="hf:llama",
        )
        data = r.to_json()
        res["applied"] = sorted({a["rule"] for a in data["applied"]})
        res["sites"] = len(data["applied"])
        res["verification"] = data["verification"]
        res["variants"] = data["variants"]
        res["best"] = data["best"]
        res["skipped"] = data.get("skipped")
        by = {v["name"]: v for v in data["variants"]}
        if "compile" in by and "opswap+compile" in by:
            res["opswap+compile_vs_compile"] = by["compile"]["ms"] / by["opswap+compile"]["ms"]
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = run()
    (args.out / f"llama_kernels_{card()}.json").write_text(
        json.dumps(res, indent=2, default=str) + "\n"
    )
    print(
        json.dumps(
            {
                k: res.get(k)
                for k in ("applied", "sites", "best", "opswap+compile_vs_compile", "error")
            },
            default=str,
        )
    )
    for v in res.get("variants", []):
        print(
            v["name"],
            round(v["ms"], 3) if v.get("ms") else None,
            v.get("verified"),
            v.get("speedup_vs_input"),
        )


if __name__ == "__main__":
    main()
