"""Chapter 30: keep opswap's model even when it does not win the race, with each
variant's accuracy beside its speed, and a static int8 model verified on the data it
was calibrated on.

The example input is `torch.randn` (as many users write it) while the model is fed
images in [0, 1]. Where static int8 is planned (the planner times it on this CPU first),
random samples like the example would clip its calibrated ranges, so the verdict is
reached on the calibration batches held out of calibration, and the random check is
printed beside it. Where opswap's model does not win the race, it is saved anyway, and
result.json's `save` says it was kept by request.

    python examples/ch30_save_candidate.py [OUT_DIR]
"""

import sys
import tempfile

import torch
from torch import nn

import opswap
from opswap.report.candidates import accuracy_cell


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    images = [(torch.rand(16, 1, 12, 12),) for _ in range(8)]  # 6 calibrate, 2 verify
    result = opswap.optimize(
        model,
        (torch.randn(16, 1, 12, 12),),
        exactness="approx",
        compare="none",
        calibration_data=images,
        save="candidate",
    )
    print(repr(result))
    print("verified on:", result.verified_on)
    if result.random_check is not None:
        print("random samples like the example (not judged):", result.random_check.passed)
    for v in result.variants:
        speed = f"{v.speedup_vs_input:.2f}x" if v.speedup_vs_input is not None else "-"
        print(f"  {v.name:<8} {speed:>6}  {accuracy_cell(v.accuracy)}")
    save = result.to_json()["save"]
    print("saved:", save["variant"], "kept by request:", save["kept_by_request"])
    print("wrote", result.save(out_dir)["model"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="opswap-ch30-cand-"))
