"""Chapter 11: lossy convolution decompositions, fitted from the trained weight.

Part 1 plans the four rules on a small conv net: a conv whose weight is nearly of low
rank is split into two thin convs by conv.low_rank (the error and the saving printed),
and the refusals of the others say why they do not pay there. Part 2 decomposes the
trained digits CNN of the zoo into CP form (rank 4) on purpose, then distils the chains
layer by layer and fine-tunes on the digits task: top-1 on the held-out split after
each step.

    python examples/ch11_decompose.py
"""

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.models.zoo_digits import digits, digits_cnn
from opswap.planner import apply_plan, make_plan
from opswap.train import distill_conv

RULES = ["conv.low_rank", "conv.cp", "conv.depthwise_separable", "conv.stacked_3x3"]


def small_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2), nn.ReLU(), nn.Conv2d(32, 48, 3, padding=1), nn.ReLU()
    )
    with torch.no_grad():  # the second conv's weight: rank 6 plus a little noise
        w = torch.randn(48, 6) @ torch.randn(6, 32 * 9)
        net[2].weight.copy_((w + 0.05 * torch.randn_like(w)).reshape(48, 32, 3, 3) / 20)
    return net.eval()


def part1() -> None:
    net = small_net()
    x = torch.randn(2, 3, 20, 20)
    cap = capture(net, (x,))
    plan = make_plan(cap, rules=RULES, exactness="lossy", keep_slower=True)
    for d in plan.decisions:
        print(f"  {d.rule}: {d.site.description}")
    for m in plan.misses:
        print(f"  not {m.rule} at {m.where}: {m.reason}")
    out = apply_plan(cap, plan).gm
    y = torch.randn(1, 3, 17, 23)  # another batch and image size
    with torch.no_grad():
        want, got = net(y), out(y)
    print(
        f"  candidate vs model at {list(y.shape)}: rel L2 {float((got - want).norm() / want.norm()):.4f}"
    )


def part2() -> None:
    torch.manual_seed(0)
    model, _, task = digits_cnn()
    d = digits()
    x, y = d.train_x.view(-1, 1, 8, 8), d.train_y
    labelled = [(x[i : i + 64], y[i : i + 64]) for i in range(0, len(y), 64)]
    cal = task.calibration[:2]
    print(f"  digits CNN: top-1 {task.evaluate(model):.4f}")
    student, done = distill_conv.decompose(model, "cp", cal, rank=4)
    for r in done:
        print(
            f"    {r.path}: CP rank {r.rank}, output error {r.output_error:.3f}, "
            f"{r.macs_after / r.macs_before:.0%} of the multiply-adds"
        )
    print(f"  CP rank 4, as fitted: top-1 {task.evaluate(student):.4f}")
    distill_conv.distill(student, model, cal, [r.path for r in done], steps=30, lr=3e-3)
    print(f"  distilled layer by layer (30 steps): top-1 {task.evaluate(student):.4f}")
    distill_conv.fine_tune(student, labelled, steps=60)
    print(f"  fine-tuned on the task (60 steps): top-1 {task.evaluate(student):.4f}")


def main() -> None:
    torch.set_num_threads(1)
    print("Part 1: the rules on a small net")
    part1()
    print("Part 2: decompose, distil, fine-tune")
    part2()


if __name__ == "__main__":
    main()
