"""Chapter 17: TopK and sort.

A retrieval head that sorts every score to keep the best 10 (sort + [:k], and argsort +
gather) becomes torch.topk (topk.sort_slice, exact: identical values); the bucketed
approximate top-k (topk.approx) is planned at approx exactness with its recall measured;
opswap's Triton top-k (topk.topk) is planned for the H200 only where the crossover table
measured it faster, and the plan says why not elsewhere. With a CUDA GPU: the kernel
against torch.topk.

    python examples/ch17_topk.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.kernels import topk as T
from opswap.planner import apply_plan, make_plan


class Retrieval(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = nn.Parameter(torch.randn(4096, 32))

    def forward(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = q @ self.items.t()  # [B, 4096]
        best, ids = torch.sort(scores, dim=-1, descending=True)
        order = torch.argsort(scores, dim=-1)[:, :5]  # the 5 worst, gathered
        return best[:, :10], ids[:, :10], torch.gather(scores, 1, order)


def main() -> None:
    torch.manual_seed(0)
    m = Retrieval().eval()
    q = torch.randn(64, 32)
    cap = capture(m, (q,), method="fx")
    plan = make_plan(cap, rules=["topk.sort_slice"])
    for d in plan.decisions:
        print(f"{d.rule:18s} {d.site.description}")
    applied = apply_plan(cap, plan)
    with torch.no_grad():
        same = all(torch.equal(a, b) for a, b in zip(m(q), applied.gm(q), strict=True))
        t0 = time.perf_counter()
        for _ in range(20):
            m(q)
        t1 = time.perf_counter()
        for _ in range(20):
            applied.gm(q)
        t2 = time.perf_counter()
    print(f"identical outputs: {same}; sort {1e3 * (t1 - t0) / 20:.2f} ms -> "
          f"topk {1e3 * (t2 - t1) / 20:.2f} ms a call on this CPU")  # fmt: skip

    approx = make_plan(
        cap, rules=["topk.sort_slice", "topk.approx"], exactness="approx", target="h200"
    )
    for d in approx.decisions:
        if d.rule == "topk.approx":
            print(f"{d.rule:18s} {d.site.description}")
    gpu = make_plan(cap, rules=["topk.sort_slice", "topk.topk"], target="h200")
    for s in [*gpu.skipped, *gpu.misses][:2]:
        print(f"topk.topk on h200: {s.reason}")
    if torch.cuda.is_available():
        x = torch.randn(4096, 32768, device="cuda")
        v, _ = T.topk(x, 64, True, True)
        print("GPU kernel values identical:", bool(torch.equal(v, torch.topk(x, 64)[0])))


if __name__ == "__main__":
    main()
