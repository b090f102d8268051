"""Chapter 6: weight-only INT8 / INT4 and FP8 Linears for the GPU.

Quantises one bfloat16 Linear of a 1.1B Llama's MLP (2048 -> 5632) three ways, runs the
registered ops (`opswap::wo_linear`, `opswap::fp8_linear`) and prints each one's error
against float64 and its weight bytes; then asks the rules what they would do with a
decode-shaped model here. On a CPU the ops take their portable paths and the rules say
why they do not apply; on a CUDA GPU the Triton kernel and `_scaled_mm` run.

    python examples/ch06_weight_only.py
"""

from __future__ import annotations

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.kernels import fp8_linear as fp8
from opswap.kernels import weight_only as wo
from opswap.planner import make_plan

dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
k, n = 2048, 5632
w = (torch.randn(n, k, device=dev) / k**0.5).bfloat16()
for rows in (1, 16):
    x = torch.randn(rows, k, device=dev).bfloat16()
    exact = x.double() @ w.double().t()
    print(f"{rows} row(s), {k} -> {n}, on {dev}:")
    print(f"  bfloat16     weight {2 * k * n / 1e6:5.1f} MB")
    for bits in (8, 4):
        q, s, o, g = wo.quantize(w, bits)
        y = wo.wo_linear(x, q, s, o, None, bits, k)
        nbytes = sum(t.numel() * t.element_size() for t in (q, s, o) if t is not None)
        err = float((y.double() - exact).norm() / exact.norm())
        groups = "per channel" if g == k else f"groups of {g}"
        print(f"  INT{bits} ({groups:12s}) weight {nbytes / 1e6:5.1f} MB, rel. error {err:.4f}")
    wq, sw = fp8.quantize_weight(w)
    y = fp8.fp8_linear(x, wq, sw, None, True)
    err = float((y.double() - exact).norm() / exact.norm())
    path = "torch._scaled_mm" if fp8.fp8_supported(dev) is None else "simulated"
    print(f"  FP8 e4m3 row-wise   weight {k * n / 1e6:5.1f} MB, rel. error {err:.4f} ({path})")
    if fp8.fp8_supported(dev):
        print(f"    (why not _scaled_mm here: {fp8.fp8_supported(dev)})")

block = nn.Sequential(nn.Linear(2048, 5632, bias=False), nn.SiLU(), nn.Linear(5632, 2048))
block = block.bfloat16().to(dev).eval()
cap = capture(block, (torch.randn(1, 2048, device=dev).bfloat16(),), method="fx")
plan = make_plan(cap, rules=["precision.*"], exactness="lossy", target="h200")
print(f"plan on target h200, one row, weights on {dev}:")
for d in plan.decisions:
    print(f"  {d.rule} at {d.site.key}: predicted {d.estimate.time_saved_s * 1e6:.1f} us saved")
for m in plan.misses:
    print(f"  {m.rule} not at {m.where}: {m.reason}")
