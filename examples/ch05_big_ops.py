"""Chapter 5: big ops for small ones.

An Inception-style block (three 1x1 branches on one input), a ResNeXt-style block (a
channel split, a 3x3 conv per slice) and a loop-unrolled set of per-head matmuls: plan
fusion.parallel_conv and fusion.batch_matmul, show what fired and what each predicts,
and check the rewritten model against the original at another batch size
(benchmarks/bench_big_ops.py times the same rewrites).

    python examples/ch05_big_ops.py
"""

from __future__ import annotations

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan

RULES = ["fusion.parallel_conv", "fusion.batch_matmul"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Conv2d(32, c, 1) for c in (16, 24, 8))
        self.groups = nn.ModuleList(nn.Conv2d(12, 12, 3, padding=1) for _ in range(4))
        self.heads = nn.ParameterList(nn.Parameter(torch.randn(14, 14) / 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, 32, 14, 14]
        h = torch.cat([b(x) for b in self.branches], 1)  # 48 channels
        parts = torch.chunk(h, 4, 1)
        g = torch.cat([conv(parts[i]) for i, conv in enumerate(self.groups)], 1).relu()
        rows = torch.chunk(g, 4, 1)
        return torch.cat([rows[i] @ self.heads[i] for i in range(4)], 1)


def main() -> None:
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 32, 14, 14)
    cap = capture(model, (x,))
    plan = make_plan(cap, rules=RULES, keep_slower=True)
    for d in plan.decisions:
        print(f"{d.rule:22s} {d.site.description}")
        saved = d.estimate.time_saved_s
        print(f"{'':22s} predicted: {d.estimate.note} ({(saved or 0) * 1e6:+.1f} us)")
    for m in plan.misses:
        print(f"miss {m.rule}: {m.reason}")
    gm = apply_plan(cap, plan).gm
    z = torch.randn(5, 32, 14, 14)  # another batch size than the example's
    with torch.no_grad():
        err = float((gm(z) - model(z)).abs().max())
    print(f"max |rewritten - original| at batch 5: {err:.2e}")
    print("timed against the original: python benchmarks/bench_big_ops.py")


if __name__ == "__main__":
    main()
