"""Chapter 15 (and 16, 8): the Triton reduction, softmax and RoPE kernels and their rules.

On any machine: plan a tiny Llama (from its config) for the H200 target and show where
reduce.sum_of_squares, softmax.softmax and fusion.rope fire and
what they predict; plan it for this CPU and show why they are skipped there. With a CUDA
GPU: run the kernels against eager PyTorch.

    python examples/ch15_reductions.py
"""

from __future__ import annotations

import torch

from opswap.graph.capture import capture
from opswap.models import load
from opswap.planner import make_plan

RULES = ["reduce.sum_of_squares", "softmax.softmax", "fusion.rope"]


def main() -> None:
    lm = load("hf:llama")
    cap = capture(lm.module, lm.example_inputs, method="export")
    plan = make_plan(cap, rules=RULES, target="h200")
    print(f"h200: {len(plan.decisions)} sites")
    for d in plan.decisions:
        print(f"  {d.rule:30s} {d.site.description}")
        print(f"  {'':30s} predicted: {d.estimate.note}")
    cpu = make_plan(cap, rules=RULES, target="cpu")
    print(f"cpu: {len(cpu.decisions)} sites; skipped {len(cpu.skipped)}, e.g.:")
    print(f"  {cpu.skipped[0].reason}" if cpu.skipped else "  (none)")
    if torch.cuda.is_available():
        from opswap.kernels import reduction, rope, softmax

        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        err = reduction.row_reduce(x, "sumsq", True, False).float() - x.float().pow(2).sum(-1)
        print("sum of squares on the GPU, max rel error:", float(err.abs().max() / 4096))
        y = softmax.softmax(x)
        print("softmax on the GPU, max |ours - eager|:", float((y - x.softmax(-1)).abs().max()))
        q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
        cos, sin = torch.ones(128, 64, device="cuda"), torch.zeros(128, 64, device="cuda")
        qo, _ = rope.rope(q, q, cos.bfloat16(), sin.bfloat16(), None, False)
        print("rope at angle 0 is the identity:", bool(torch.equal(qo, q)))


if __name__ == "__main__":
    main()
