"""The lossy conv decompositions (chapter 11): time per layer at ResNet-like shapes, and
accuracy on the digits task before and after fine-tuning.

    PYTHONPATH=src python benchmarks/bench_conv_decompose.py [--out DIR] [--device cpu|cuda]
        [--quick] [--skip-accuracy]

Timing: each conv (ResNet-like: 3x3 at 64/128/256 channels and 56/28/14 pixels, a
strided 3x3, a 5x5 and a 7x7 for the stacked 3x3s) against each decomposition at the rank
that keeps about half of its multiply-adds (`max_rank(keep=0.5)`; the stacked 3x3s at
the widest middle within 90%, their only setting), at batch 1 and 8, float32, timed in
one interleaved loop (opswap.bench.timing). The weights are random: the time of a chain
depends on its shape, not its values. Each row: the multiply-adds and weights kept, the
median ms of the conv and of the chain, the speed-up with its 95% interval.

Accuracy: the zoo's digits CNN (3x3 convs; its first conv reads one channel and is left
as it is) decomposed by each method at a fixed rank, and a digits CNN with a 5x5 conv
trained here for the stacked 3x3s: top-1 on the 360 held-out images for the original,
after the replacement, after layer-wise distillation (30 steps) and after fine-tuning
on the training split (60 steps of Adam, batch 64), with the per-layer output errors and
the CPU time of each step. Writes DIR/conv_decompose_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import compare_variants, write_results  # noqa: E402

from opswap.rules.conv._decompose import fit, layer_of, max_rank, stacked_3x3  # noqa: E402
from opswap.rules.conv.stacked_3x3 import mid_channels  # noqa: E402

#: (name, in, out, kernel, stride, image): ResNet-like layers, and large kernels
SHAPES = [
    ("res2_3x3", 64, 64, 3, 1, 56),
    ("res3_3x3", 128, 128, 3, 1, 28),
    ("res4_3x3", 256, 256, 3, 1, 14),
    ("res3_down", 64, 128, 3, 2, 56),
    ("conv_5x5", 64, 64, 5, 1, 28),
    ("conv_7x7", 32, 32, 7, 1, 56),
]
#: the ranks the accuracy rows use on the zoo CNN (8 and 16 -> 16 and 32 channels)
ACCURACY = [("channel", 4), ("spatial", 4), ("cp", 4), ("depthwise", 1)]


def time_layers(device: str, quick: bool) -> list[dict[str, Any]]:
    rows = []
    for name, c, o, k, s, hw in SHAPES:
        torch.manual_seed(0)
        conv = nn.Conv2d(c, o, k, stride=s, padding=k // 2)
        layer = layer_of(conv)
        methods: list[tuple[str, int]] = []
        if k == 3:
            for m in ("channel", "spatial", "cp", "depthwise"):
                r = max_rank(layer, m, hw, hw, 0.5)
                if r:
                    methods.append((m, r))
        else:
            mid = mid_channels(layer, hw, hw)
            if mid:
                methods.append(("stacked", mid))
        for method, rank in methods:
            t0 = time.process_time()
            if method == "stacked":  # timed only: a few sweeps, the fit's quality aside
                dec = stacked_3x3(layer, rank, iters=3)
            else:
                dec = fit(layer, method, rank)
            fit_s = time.process_time() - t0
            chain = dec.module(torch.float32, torch.device(device)).eval()
            ref = conv.to(device).eval()
            for batch in (1, 8):
                x = torch.randn(batch, c, hw, hw, device=device)
                res = compare_variants(
                    {"conv": ref, "chain": chain},
                    (x,),
                    "conv",
                    device=device,
                    min_time_s=0.3 if quick else 1.0,
                    max_time_s=2.0 if quick else 10.0,
                )
                timed = {r["name"]: r for r in res}
                rows.append(
                    {
                        "layer": name,
                        "conv": f"{c}->{o} {k}x{k} stride {s} at {hw}x{hw}",
                        "method": method,
                        "rank": rank,
                        "batch": batch,
                        "macs_kept": dec.macs(hw, hw) / layer.macs(hw, hw),
                        "params_kept": dec.params() / layer.params(),
                        "conv_ms": timed["conv"]["ms"],
                        "chain_ms": timed["chain"]["ms"],
                        "speedup": timed["chain"]["speedup_vs_conv"],
                        "speedup_ci": timed["chain"]["speedup_ci"],
                        "fit_cpu_s": fit_s,
                    }
                )
                print(
                    f"{name:10s} {method:9s} r={rank:<4d} b={batch} macs {rows[-1]['macs_kept']:.2f} "
                    f"conv {rows[-1]['conv_ms']:.3f} ms chain {rows[-1]['chain_ms']:.3f} ms "
                    f"x{rows[-1]['speedup']:.2f}",
                    flush=True,
                )
    return rows


class CNN5(nn.Module):
    """A digits CNN with a 5x5 conv in the middle (16 -> 16 channels at 8x8)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 5, padding=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.f(x).flatten(1))


def accuracy() -> list[dict[str, Any]]:
    from opswap.models.zoo_digits import digits, digits_cnn
    from opswap.train import distill_conv as dc

    torch.manual_seed(0)
    model, _, task = digits_cnn()
    data = digits()
    x, y = data.train_x.view(-1, 1, 8, 8), data.train_y
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    labelled = [(x[order[i : i + 64]], y[order[i : i + 64]]) for i in range(0, len(y), 64)]
    cal = task.calibration[:2]
    torch.manual_seed(0)
    cnn5 = CNN5()
    dc.fine_tune(cnn5, labelled, steps=150, lr=3e-3)
    rows = []
    for method, rank, teacher, name in [
        *[(m, r, model, "zoo:digits_cnn") for m, r in ACCURACY],
        ("stacked", None, cnn5, "digits CNN with a 5x5 conv (trained here, 150 steps)"),
    ]:
        reference = task.evaluate(teacher)
        t0 = time.process_time()
        student, done = dc.decompose(teacher, method, cal, rank=rank)
        t1 = time.process_time()
        replaced = task.evaluate(student)
        dc.distill(student, teacher, cal, [r.path for r in done], steps=30, lr=3e-3)
        t2 = time.process_time()
        distilled = task.evaluate(student)
        dc.fine_tune(student, labelled, steps=60)
        t3 = time.process_time()
        tuned = task.evaluate(student)
        rows.append(
            {
                "model": name,
                "method": method,
                "rank": rank,
                "layers": [r.to_json() for r in done],
                "top1_reference": reference,
                "top1_replaced": replaced,
                "top1_distilled": distilled,
                "top1_fine_tuned": tuned,
                "cpu_s": {"decompose": t1 - t0, "distill": t2 - t1, "fine_tune": t3 - t2},
            }
        )
        print(
            f"{method:9s} rank {rank}: top-1 {reference:.3f} -> replaced {replaced:.3f}, "
            f"distilled {distilled:.3f}, fine-tuned {tuned:.3f}",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="short timing loops")
    p.add_argument("--skip-accuracy", action="store_true")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda asked for, and torch sees no GPU here.")
    device_name = (
        torch.cuda.get_device_name(0)
        if a.device == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)"
    )
    layers = time_layers(a.device, a.quick)
    acc = [] if a.skip_accuracy else accuracy()
    tag = "cpu" if a.device == "cpu" else ("h100" if "H100" in device_name else "h200")
    write_results(
        a.out,
        f"conv_decompose_{tag}.json",
        device_name,
        layers,
        accuracy=acc,
        quick=a.quick,
    )


if __name__ == "__main__":
    main()
