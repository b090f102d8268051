"""Chapter 14: reshape and transpose. Plan the layout rules on a small CNN with a
token-mixing head, written the way ported code often is (round-trip transposes, a
.contiguous() before a matmul, eval-mode Dropout, x @ W.t()), apply the plan, and check
the numbers. Planned twice: for this CPU, which prefers NCHW, channels_last is skipped
with its reason; for an H100, which prefers NHWC, it is applied.

    python examples/ch14_layout.py
"""

import torch
from torch import nn

from opswap.api import capture
from opswap.planner import apply_plan, make_plan


class LayoutDemo(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, stride=2),
            nn.ReLU(),
        )
        self.proj = nn.Parameter(torch.randn(24, 16) / 4)  # [out, in], used as x @ W.t()
        self.drop = nn.Dropout(0.1)
        self.idn = nn.Identity()
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        f = self.stem(x)  # f: [B, C, H, W]
        tokens = f.flatten(2).transpose(1, 2)  # tokens: [B, H*W, C]
        tokens = tokens.transpose(1, 2).transpose(1, 2)  # a round trip a refactor left
        y = self.drop(tokens @ self.proj.t())  # y: [B, H*W, 24]
        scores = y @ y.transpose(1, 2).contiguous()  # scores: [B, H*W, H*W]
        z = self.idn(torch.softmax(scores, dim=-1) @ y).contiguous()
        z = z.view(z.size(0), -1, 24).mean(1)  # a view to the shape z already has
        return self.head(z)


def main() -> None:
    torch.manual_seed(0)
    model = LayoutDemo().eval()
    x = torch.randn(2, 3, 15, 13)
    captured = capture(model, (x,))
    for target in ("cpu", "h100"):
        plan = make_plan(captured, target=target, rules="layout.*")
        print(f"== target {target}: {len(plan.decisions)} sites")
        for d in plan.decisions:
            print(f"  site  {d.rule:<24} {d.site.key:<28} {d.estimate.note}")
        for m in plan.misses:
            print(f"  miss  {m.rule:<24} {m.where}: {m.reason}")
        for s in plan.skipped:
            print(f"  skip  {s.rule:<24} {s.where}: {s.reason}")
        applied = apply_plan(captured, plan)
        fresh = torch.randn_like(x)
        with torch.no_grad():
            err = (applied.gm(fresh) - model(fresh)).abs().max().item()
        print(f"  max abs error vs the original on fresh inputs: {err:.2e}")


if __name__ == "__main__":
    main()
