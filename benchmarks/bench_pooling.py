"""Pooling rewrites (chapter 13): digits accuracy of the lossy ones before and after
fine-tuning, and CPU time of each rewritten layer against the original.

    PYTHONPATH=src python3 benchmarks/bench_pooling.py            # CPU, one thread
    PYTHONPATH=src python3 benchmarks/bench_pooling.py --device cuda

Accuracy (opswap.train.finetune_pooling.lossy_accuracy on its digits net: conv, MaxPool 2,
conv, AvgPool 2, flatten + Linear 128 -> 10): top-1 on the 360 held-out images of the
original, of the model as the rule leaves it, and after fine-tuning it for 2 and for 4
epochs on the training split (Adam, lr 1e-3).

Time, each layer alone at batch 1 and 8, rewritten by opswap's own plan and apply:
- adaptive_avg_mean: AdaptiveAvgPool2d(1) + flatten on [N, 512, 7, 7] -> mean;
- max_to_avg: MaxPool2d(3, 2, 1) on [N, 64, 56, 56] -> AvgPool2d (count_include_pad off);
- strided_conv: AvgPool2d(2) on [N, 64, 56, 56] -> a depthwise conv, stride 2;
- gap_head: flatten + Linear(256 * 7 * 7 -> 1000) on [N, 256, 7, 7] -> mean + Linear(256
  -> 1000);
- pool_before_conv: conv 1x1 256 -> 128 then AvgPool2d(2) on [N, 256, 56, 56] (DenseNet's
  first transition) -> the pool first.

Writes DIR/pooling_<device>.json (cpu, h100 or h200) with the date, device and versions.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, compare_variants, write_results  # noqa: E402

LOSSY = ("pooling.max_to_avg", "pooling.strided_conv", "pooling.gap_head")


def accuracy_rows() -> list[dict]:
    from opswap.train.finetune_pooling import digits_pool_net, lossy_accuracy

    model, example, task = digits_pool_net()
    rows = []
    for rule in LOSSY:
        for epochs in (2, 4):
            r = lossy_accuracy(model, example, task, rule, epochs=epochs)
            rows.append({"kind": "accuracy", "metric": task.metric, **r.to_json()})
            print(rows[-1], flush=True)
    return rows


def layers(batch: int) -> dict:
    return {
        "pooling.adaptive_avg_mean": (
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
            torch.randn(batch, 512, 7, 7),
            "exact",
        ),
        "pooling.max_to_avg": (nn.MaxPool2d(3, 2, 1), torch.randn(batch, 64, 56, 56), "lossy"),
        "pooling.strided_conv": (nn.AvgPool2d(2), torch.randn(batch, 64, 56, 56), "lossy"),
        "pooling.gap_head": (
            nn.Sequential(nn.Flatten(), nn.Linear(256 * 49, 1000)),
            torch.randn(batch, 256, 7, 7),
            "lossy",
        ),
        # DenseNet-121's first transition: conv 1x1 256 -> 128, then AvgPool 2
        "pooling.pool_before_conv": (
            nn.Sequential(nn.Conv2d(256, 128, 1), nn.AvgPool2d(2)),
            torch.randn(batch, 256, 56, 56),
            "exact",
        ),
    }


def time_rows(device: str, min_time_s: float) -> list[dict]:
    from opswap.graph.capture import capture
    from opswap.planner import apply_plan, make_plan

    rows = []
    for batch in (1, 8):
        for rule, (model, x, exactness) in layers(batch).items():
            model = model.eval()
            # only the batch stays symbolic: a pool alone takes any channel count, which
            # a depthwise weight does not
            cap = capture(model, (x,), dynamic="batch")
            plan = make_plan(cap, rules=[rule], exactness=exactness, keep_slower=True)
            gm = apply_plan(cap, plan).gm.to(device)
            model = model.to(device)
            fns = {"original": model, "rewritten": gm}
            for r in compare_variants(
                fns, (x.to(device),), "original", device=device, min_time_s=min_time_s
            ):
                rows.append(
                    {
                        "kind": "time",
                        "rule": rule,
                        "batch": batch,
                        "shape": list(x.shape),
                        "sites": len(plan.decisions),
                        **r,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (cpu only)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per layer at least")
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    rows = [] if args.skip_accuracy else accuracy_rows()
    rows += time_rows(args.device, args.min_time)
    tag = "cpu" if args.device == "cpu" else card()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    write_results(
        args.out,
        f"pooling_{tag}.json",
        name,
        rows,
        threads=torch.get_num_threads() if args.device == "cpu" else None,
    )


if __name__ == "__main__":
    main()
