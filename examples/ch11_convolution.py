"""Chapter 11: convolution algorithms, raced per site. A small CNN with a 3x3 conv, a
large-kernel (15x15) conv and a long 1-D conv (kernel 63); the rule `conv.algorithm`
times PyTorch's conv (NCHW and channels-last) against im2col + GEMM, the FFT and any
other registered algorithm at each site on this CPU, keeps the fastest only where it
beats PyTorch's, and says why the others lost. Then the plan is applied and checked
against the model at the example's batch and at another.

    python examples/ch11_convolution.py
"""

import torch
from torch import nn

from opswap.api import capture
from opswap.bench.timing import with_timer
from opswap.planner import apply_plan, make_plan
from opswap.targets import get_target


class LargeKernelNet(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.large = nn.Conv2d(c, c, 15, padding=7)  # a RepLKNet-style large kernel
        self.long = nn.Conv1d(c, c, 63, padding=31)  # a long convolution over the pixels

    def forward(self, x):  # x: [B, 3, H, W]
        y = torch.relu(self.stem(x))
        y = self.large(y) + y
        return self.long(y.flatten(2)).mean(-1)


def main() -> None:
    torch.manual_seed(0)
    model = LargeKernelNet().eval()
    x = torch.randn(2, 3, 48, 48)
    captured = capture(model, (x,))
    target = with_timer(get_target("cpu"))  # the race needs a timer on the target
    plan = make_plan(captured, target=target, rules=["conv.*"], exactness="approx")

    print("chosen:")
    for d in plan.decisions:
        e = d.estimate
        times = ", ".join(
            f"{n} {t * 1e3:.2f} ms" for n, t in sorted(e.measured_s.items(), key=lambda kv: kv[1])
        )
        print(f"  {d.site.data['conv']}: {d.site.data['algorithm']} (measured: {times})")
    print("left to PyTorch's conv, or lost:")
    for s in plan.skipped:
        print(f"  {s.where}: {s.reason[:160]}")
    for m in plan.misses:
        print(f"  miss {m.where}: {m.reason}")

    applied = apply_plan(captured, plan)
    for batch in (2, 5):
        xb = torch.randn(batch, 3, 48, 48)
        with torch.no_grad():
            want, got = model(xb), applied.gm(xb)
        err = float((got - want).norm() / want.norm())
        print(f"batch {batch}: relative L2 error against the model {err:.1e}")
        assert err < 1e-4


if __name__ == "__main__":
    main()
