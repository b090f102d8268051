"""Chapter 13: pooling rewrites.

Exact: a DenseNet-style transition (1x1 conv, AvgPool 2) and a global-average-pool head
are planned with pooling.pool_before_conv and pooling.adaptive_avg_mean and checked
against the original at another batch size (benchmarks/bench_pooling.py times them).
Lossy: on a small CNN trained on scikit-learn's digits, each lossy pooling rule is
applied and the held-out top-1 is shown before the swap, right after it, and after one
epoch of fine-tuning (opswap.train.finetune_pooling).

    python examples/ch13_pooling.py
"""

from __future__ import annotations

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan
from opswap.train.finetune_pooling import digits_pool_net, lossy_accuracy


class Transition(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(64, 32, 1)
        self.pool = nn.AvgPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, 64, H, W]
        return self.fc(self.gap(self.pool(self.conv(x))).flatten(1))


def exact() -> None:
    torch.manual_seed(0)
    model = Transition().eval()
    x = torch.randn(4, 64, 28, 28)
    cap = capture(model, (x,))
    plan = make_plan(cap, rules=["pooling.*"])
    for d in plan.decisions:
        print(f"{d.rule:28s} {d.site.description}")
    gm = apply_plan(cap, plan).gm
    z = torch.randn(1, 64, 28, 28)
    with torch.no_grad():
        print(f"max |rewritten - original| at batch 1: {float((gm(z) - model(z)).abs().max()):.1e}")
    print("timed layer by layer: python benchmarks/bench_pooling.py")


def lossy() -> None:
    model, example, task = digits_pool_net()
    print(f"digits net, top-1 on {task.description}")
    for rule in ("pooling.max_to_avg", "pooling.strided_conv", "pooling.gap_head"):
        r = lossy_accuracy(model, example, task, rule, epochs=1)
        print(
            f"  {rule:22s} original {r.reference:.3f}  swapped {r.replaced:.3f}  "
            f"fine-tuned (1 epoch) {r.fine_tuned:.3f}"
        )


if __name__ == "__main__":
    exact()
    lossy()
