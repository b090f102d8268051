"""Chapter 16 (and 8): opswap's own FlashAttention in Triton and the rule that installs it.

On any machine: plan a tiny bf16 attention block (grouped-query heads and a padding
mask, then a causal pass) for the H200 target and show the two SDPA sites the rule
matches and what the planner decides from the measured crossover table (SDPA is kept
where the kernel is not yet measured faster); plan it for this CPU and show why it is
skipped there; run the op on the CPU (the reference) against SDPA, forward and
gradients. With a CUDA GPU: run the Triton kernels against SDPA and time both.

    python examples/ch16_flash_attention.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opswap.graph.capture import capture
from opswap.kernels.flash_attention import flash_attention
from opswap.planner import make_plan

RULE = "attention.flash"


class Block(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.d = d
        self.q, self.kv = nn.Linear(32, 4 * d), nn.Linear(32, 2 * 2 * d)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, self.d).transpose(1, 2)  # [B, 4, S, D]
        k, v = self.kv(x).view(b, s, 2, 2, self.d).permute(2, 0, 3, 1, 4)  # [B, 2, S, D]
        keep = (x[..., 0] > -3.0)[:, None, None, :]  # a key-padding mask [B, 1, 1, S]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        return F.scaled_dot_product_attention(a, a, a, is_causal=True)


def main() -> None:
    torch.manual_seed(0)
    model = Block().to(torch.bfloat16).eval()
    x = torch.randn(2, 11, 32, dtype=torch.bfloat16)
    cap = capture(model, (x,), method="export")
    for target in ("h200", "cpu"):
        plan = make_plan(cap, rules=[RULE], target=target)
        print(f"{target}: {len(plan.decisions)} sites replaced, {len(plan.skipped)} kept")
        for d in plan.decisions:
            print(f"  replaced {d.site.description}: {d.estimate.note}")
        for s in plan.skipped:
            print(f"  kept {s.where}: {s.reason}")
        for m in plan.misses:
            print(f"  refused: {m.reason}")

    q = torch.randn(2, 8, 37, 64, requires_grad=True)
    k, v = torch.randn(2, 2, 53, 64), torch.randn(2, 2, 53, 64)
    o = flash_attention(q, k, v, causal=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (g,) = torch.autograd.grad(o.sum(), q)
    (wg,) = torch.autograd.grad(want.sum(), q)
    print(
        "CPU op vs SDPA (causal, GQA 8/2, S_q 37, S_k 53): max |o| "
        f"{float((o - want).detach().abs().max()):.1e}, max |dq| {float((g - wg).abs().max()):.1e}"
    )
    if torch.cuda.is_available():
        import triton.testing

        q, k, v = (
            torch.randn(8, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        o = flash_attention(q, k, v, causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        rel = float((o.float() - want.float()).norm() / want.float().norm())
        ours = triton.testing.do_bench(lambda: flash_attention(q, k, v, causal=True))
        sdpa = triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        )
        tf = 4 * 8 * 16 * 2048 * 2048 * 128 * 0.5 / 1e12
        print(f"GPU 8x16x2048x128 causal bf16: rel L2 vs SDPA {rel:.1e}")
        print(f"  ours {ours:.3f} ms ({tf / ours * 1e3:.0f} TFLOP/s), SDPA {sdpa:.3f} ms")


if __name__ == "__main__":
    main()
