"""Chapter 12: matrix multiply. An MLP block with a residual, planned for the H200 with
matmul.gemm (opswap's tiled Triton GEMM, bias + activation + residual in its epilogue):
without a timer the rule asks for a measurement; with one it races cuBLAS against ours
per site and keeps the faster. Then matmul.tf32 at --exactness approx for the float32
block, applied here and checked at another batch size; and, where CUDA exists, the
kernel itself against cuBLAS.

    python examples/ch12_gemm.py
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from opswap.bench.timing import fastest
from opswap.graph.capture import capture
from opswap.kernels import gemm as kg
from opswap.planner import apply_plan, make_plan
from opswap.targets import get_target


class MLP(nn.Module):
    def __init__(self, d: int = 256, h: int = 704):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(F.silu(self.up(x)))  # the SiLU and the residual fold


def show(title: str, plan) -> None:
    print(f"{title}: {len(plan.decisions)} sites")
    for d in plan.decisions:
        print(f"  {d.rule:13s} {d.site.description}  [{d.estimate.note[:90]}]")
    for s in plan.skipped:
        print(f"  skipped {s.rule}: {s.reason[:150]}")


def main() -> None:
    torch.manual_seed(0)
    block, x = MLP().eval(), torch.randn(8, 32, 256)
    cap = capture(block, (x,))
    show("h200, no timer", make_plan(cap, target="h200", rules=["matmul.gemm"]))
    # a timer on the target: here it times the two on this machine (on a CPU both are
    # PyTorch's product, so the race shows the mechanism, not a GPU's answer)
    timed = dataclasses.replace(get_target("h200"), timer=fastest)
    show("h200, timed here", make_plan(cap, target=timed, rules=["matmul.gemm"]))

    tf32 = make_plan(cap, target="h200", rules=["matmul.*"], exactness="approx")
    show("h200, approx (TF32)", tf32)
    applied = apply_plan(cap, tf32)
    x2 = torch.randn(3, 5, 256)  # another batch and sequence length
    with torch.no_grad():
        err = float((applied.gm(x2) - block(x2)).abs().max())
    # on a CPU the op multiplies in float32: TF32 exists on a GPU only
    print(f"TF32 candidate at batch 3 x 5 on {x2.device}: max abs {err:.2e} against the block")

    if torch.cuda.is_available():
        import triton.testing

        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 4096**-0.5
        ours = lambda: kg.gemm(a, w, None, None, "none", True, "ieee")  # noqa: E731
        cublas = lambda: F.linear(a, w)  # noqa: E731
        rel = float((ours().float() - cublas().float()).norm() / cublas().float().norm())
        for name, fn in (("opswap::gemm", ours), ("cuBLAS", cublas)):
            ms = triton.testing.do_bench(fn, return_mode="median")
            print(f"{name:13s} 4096^3 bf16: {2 * 4096**3 / ms / 1e9:.0f} TFLOP/s")
        print(f"relative L2 against cuBLAS: {rel:.1e}")
    else:
        y = kg.gemm(x, block.up.weight, block.up.bias, None, "silu", True, "ieee")
        ref = kg.reference(x, block.up.weight, block.up.bias, None, "silu", True, "ieee")
        print(
            f"no CUDA here: opswap::gemm ran its PyTorch reference ({tuple(y.shape)}), "
            f"equal: {torch.equal(y, ref)}"
        )


if __name__ == "__main__":
    main()
