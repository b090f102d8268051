"""Chapter 4: fusion. Plan the fusion rules on a small CNN + attention model that holds
every pattern (Conv+BN+ReLU, Linear+BatchNorm1d, x @ W + b, Q/K/V Linears on one
input, a hand-written LayerNorm, log(softmax)) and two near-misses, apply the plan,
check the numbers on fresh inputs and time both models.

    python examples/ch04_fusion.py
"""

import time

import torch
from torch import nn

from opswap.api import capture
from opswap.planner import apply_plan, make_plan


def _bn(kind, c: int) -> nn.Module:
    bn = kind(c)
    with torch.no_grad():  # statistics of a trained network, not the identity
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    return bn


class FusionDemo(nn.Module):
    def __init__(self, c: int = 32, h: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1),
            _bn(nn.BatchNorm2d, c),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1),
            _bn(nn.BatchNorm2d, c),
            nn.ReLU(),
        )
        self.side = nn.Conv2d(c, c, 1)
        self.side_bn = _bn(nn.BatchNorm2d, c)
        self.embed = nn.Parameter(torch.randn(c, h) / c**0.5)  # used as tokens @ embed + bias
        self.embed_bias = nn.Parameter(0.1 * torch.randn(h))
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.gamma, self.beta = nn.Parameter(1 + 0.1 * torch.randn(h)), nn.Parameter(torch.randn(h))
        self.fc, self.fc_bn = nn.Linear(h, h), _bn(nn.BatchNorm1d, h)
        self.head = nn.Linear(h, 10)

    def forward(self, x):  # x: [B, 3, H, W]
        f = self.stem(x)
        s = self.side(f)
        f = f + self.side_bn(s) + s  # s is read twice: its BN cannot be folded (a miss)
        t = f.flatten(2).transpose(1, 2) @ self.embed + self.embed_bias  # t: [B, HW, h]
        b, n, h = t.shape
        q = self.q(t).view(b, n, self.heads, -1).transpose(1, 2)  # q: [B, heads, HW, d]
        k = self.k(t).view(b, n, self.heads, -1).transpose(1, 2)
        v = self.v(t).view(b, n, self.heads, -1).transpose(1, 2)
        a = torch.softmax(q @ k.transpose(-2, -1) / (h // self.heads) ** 0.5, dim=-1) @ v
        t = t + a.transpose(1, 2).reshape(b, n, h)
        m = t.mean(-1, keepdim=True)
        t = (t - m) / torch.sqrt(
            ((t - m) ** 2).mean(-1, keepdim=True) + 1e-5
        ) * self.gamma + self.beta
        z = torch.relu(self.fc_bn(self.fc(t.mean(1))))  # z: [B, h]
        m = z.mean(-1, keepdim=True)
        z = (z - m) / torch.sqrt(z.var(-1, keepdim=True) + 1e-5)  # unbiased: not a LayerNorm
        return torch.log(torch.softmax(self.head(z), dim=-1))


def _median_ms(ref, opt, x, budget_s: float = 2.0, pairs: int = 30) -> tuple[float, float]:
    """Median latency of two models called alternately (so machine noise hits both
    alike), within a time budget."""
    times: tuple[list[float], list[float]] = ([], [])
    with torch.inference_mode():  # the fused conv kernel runs when no gradient is needed
        ref(x), opt(x)  # warm-up: oneDNN builds its kernels and reorders weights once
        start = time.perf_counter()
        while len(times[0]) < pairs and time.perf_counter() - start < budget_s:
            for fn, acc in ((ref, times[0]), (opt, times[1])):
                t0 = time.perf_counter()
                fn(x)
                acc.append(time.perf_counter() - t0)
    return tuple(sorted(t)[len(t) // 2] * 1e3 for t in times)


def main() -> None:
    torch.manual_seed(0)
    model = FusionDemo().eval()
    x = torch.randn(4, 3, 24, 20)
    captured = capture(model, (x,))
    plan = make_plan(captured, target="cpu", rules="fusion.*")
    print(f"captured with {captured.method}; {len(plan.decisions)} fusion sites")
    for d in plan.decisions:
        print(f"  site  {d.rule:<24} {d.site.key:<28} saves {d.estimate.bytes_saved / 1e3:7.1f} kB")
    for m in plan.misses:
        print(f"  miss  {m.rule:<24} {m.where}: {m.reason}")
    applied = apply_plan(captured, plan)
    fresh = torch.randn_like(x)
    with torch.no_grad():
        ref, out = model(fresh), applied.gm(fresh)
    print(f"max abs error vs the original on fresh inputs: {(out - ref).abs().max().item():.2e}")
    ref_ms, opt_ms = _median_ms(captured.gm, applied.gm, x)
    print(
        f"CPU latency (median, alternating calls): {ref_ms:.2f} ms -> {opt_ms:.2f} ms "
        f"({ref_ms / opt_ms:.2f}x)"
    )


if __name__ == "__main__":
    main()
