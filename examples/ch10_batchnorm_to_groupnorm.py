"""Chapter 10: BatchNorm -> GroupNorm, and a short distillation that recovers the accuracy.

A small conv net with BatchNorm is trained briefly on scikit-learn's digits; every
BatchNorm of a copy becomes a GroupNorm (8 groups) whose affine starts from the running
statistics; the copy is distilled to the BatchNorm model's logits. Top-1 on the held-out
split is printed for the BatchNorm model, the swap as it starts, and after distilling;
then the GroupNorm model is run at batch 1, which it computes like any other batch.

    python examples/ch10_batchnorm_to_groupnorm.py
"""

import torch
import torch.nn.functional as F
from torch import nn

from opswap.models.zoo_digits import digits
from opswap.train import norm_swap


def net() -> nn.Module:
    def block(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
        conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        return [conv, nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(*block(1, 16), *block(16, 32, 2), nn.Flatten(), nn.Linear(512, 10))


def top1(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model.eval()(x).argmax(1) == y).float().mean())


def main() -> None:
    torch.manual_seed(0)
    d = digits()
    x, y = d.train_x.reshape(-1, 1, 8, 8), d.train_y
    xt, yt = d.test_x.reshape(-1, 1, 8, 8), d.test_y
    teacher = net()
    opt = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    teacher.train()
    for _ in range(3):  # three epochs: a few seconds
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 64):
            idx = perm[i : i + 64]
            opt.zero_grad()
            F.cross_entropy(teacher(x[idx]), y[idx]).backward()
            opt.step()
    teacher.eval()
    print(f"BatchNorm model, 3 epochs: top-1 {top1(teacher, xt, yt):.4f} ({len(yt)} held out)")

    batches = [x[i : i + 64] for i in range(0, len(x), 64)]
    for init in ("affine", "stats"):
        s = norm_swap.prepare(teacher, "group", 8, init=init)
        print(f"  swapped, affine from {init:<6}: top-1 {top1(s, xt, yt):.4f}")
    student = norm_swap.prepare(teacher, "group", 8)
    losses = norm_swap.distill(student, teacher, batches, steps=100, lr=3e-3)
    print(
        f"  distilled 100 steps (MSE to the logits {losses[0]:.3f} -> {losses[-1]:.3f}): "
        f"top-1 {top1(student, xt, yt):.4f}"
    )
    with torch.no_grad():
        one = student(xt[:1])  # per-sample statistics: batch 1 is just another batch
        same = torch.allclose(one, student(xt[:8])[:1], atol=1e-5)
    print(f"  GroupNorm model at batch 1 gives what it gives that sample in a batch of 8: {same}")


if __name__ == "__main__":
    main()
