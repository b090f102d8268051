"""Never slower: `optimize` on every zoo model and on Hugging Face types, and what it saved.

    PYTHONPATH=src python benchmarks/bench_never_slower.py [--compare none|compile] [--out DIR]

For each model the variants race runs in one process (input, capture, opswap's result,
and with --compare compile the torch.compile baselines); the row records the saved
variant (timed as reloaded from the model.pt2 it saves), its time against the input's in
the same run with the 95% bootstrap interval of the ratio, and whether the saved variant
is the input itself. The claim checked: the saved variant is the input, or it beat the
input beyond the run's noise (the interval's lower end above 1).
Writes DIR/never_slower_<device>.json with device, versions and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
HF = [
    "bert",
    "roberta",
    "distilbert",
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "vit",
    "resnet",
    "mobilenet_v2",
    "convnext",
    "t5",
    "bart",
    "clip",
    "deit",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", default="none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from opswap.bench.timing import describe_device
    from opswap.config import OptimizeConfig
    from opswap.models import list_zoo, load
    from opswap.pipeline import optimize

    specs = [f"zoo:{z.name}" for z in list_zoo()] + [f"hf:{t}" for t in HF]
    rows = []
    for spec in specs:
        row: dict = {"model": spec}
        try:
            m = load(spec)
            t0 = time.time()
            r = optimize(
                m.module,
                m.example_inputs,
                OptimizeConfig(device=args.device, compare=args.compare, layers=False, samples=2),
                name=spec,
            )
            data = r.to_json()
            by = {v["name"]: v for v in data["variants"]}
            saved = by[data["best"]]
            row.update(
                {
                    "seconds": round(time.time() - t0, 1),
                    "applied": len(data["applied"]),
                    "best": data["best"],
                    "saved_is_input": data["best"] == "input",
                    "input_ms": by["input"]["ms"],
                    "saved_ms": saved["ms"],
                    "saved_speedup_vs_input": saved["speedup_vs_input"],
                    "saved_speedup_ci": saved["speedup_ci"],
                    "opswap_speedup_vs_input": by["opswap"]["speedup_vs_input"],
                    "opswap_speedup_ci": by["opswap"]["speedup_ci"],
                    "never_slower": data["best"] == "input" or saved["speedup_ci"][0] > 1.0,
                    "run": data["run"],
                    "variants": data["variants"],
                    "deploy": data["deploy"],
                }
            )
        except Exception as e:  # one model failing must not lose the other rows
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-2000:]
        print(
            json.dumps(
                {
                    k: row.get(k)
                    for k in (
                        "model",
                        "best",
                        "saved_speedup_vs_input",
                        "opswap_speedup_vs_input",
                        "never_slower",
                        "error",
                    )
                }
            ),
            flush=True,
        )
        rows.append(row)
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": describe_device(args.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "compare": args.compare,
        "peer": "input (eager, the model as given), timed in the same interleaved run",
        "rows": rows,
        "all_never_slower": all(r.get("never_slower") for r in rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"never_slower_{args.device.split(':')[0]}.json"
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
