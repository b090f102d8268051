"""Chapter 10 (and 9): the Triton RMSNorm, add + RMSNorm and SwiGLU kernels.

On any machine: plan a tiny Llama (from its config) for the H200 target and show where
the norm and activation rules fire and what they predict; plan it for this CPU and show
why they are skipped there. With a CUDA GPU: run the kernels against eager PyTorch.

    python examples/ch10_triton_norm.py
"""

from __future__ import annotations

import torch

from opswap.graph.capture import capture
from opswap.models import load
from opswap.planner import make_plan


def main() -> None:
    lm = load("hf:llama")
    cap = capture(lm.module, lm.example_inputs, method="export")
    rules = ["norm.*", "activation.*"]
    plan = make_plan(cap, rules=rules, target="h200")
    print(f"h200: {len(plan.decisions)} sites")
    for d in plan.decisions:
        print(f"  {d.rule:28s} {d.site.description}")
        print(f"  {'':28s} predicted: {d.estimate.note}")
    cpu = make_plan(cap, rules=["activation.*"], target="cpu")
    print(f"cpu: {len(cpu.decisions)} sites; skipped {len(cpu.skipped)}, e.g.:")
    print(f"  {cpu.skipped[0].reason}" if cpu.skipped else "  (none)")
    if torch.cuda.is_available():
        from opswap.kernels import rms_norm, swiglu

        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
        y = rms_norm.rms_norm(x, w, 1e-6, 0.0, True)
        ref = rms_norm.reference(x, w, 1e-6)[0]
        print("rms_norm on the GPU, max |ours - eager|:", float((y - ref).abs().max()))
        g, u = x, torch.randn_like(x)
        print(
            "swiglu on the GPU, max |ours - eager|:",
            float((swiglu.glu(g, u, "silu") - torch.nn.functional.silu(g) * u).abs().max()),
        )


if __name__ == "__main__":
    main()
