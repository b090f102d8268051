"""Chapter 18: embeddings.

A recommender with 8 tables looked up from one batch, each written as
`emb(ids).sum(1)`: embedding.bag turns each into an embedding bag, embedding.batched the
eight into one table-batched lookup (exact), and embedding.int8 stores the table in
int8 with a scale and bias per row (approx), reporting the memory. Outputs compared with
the user's model, and the model timed before and after on this CPU.

    python examples/ch18_embedding.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.planner import apply_plan, make_plan


class Tables(nn.Module):
    def __init__(self, tables: int = 8, rows: int = 3000, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.ModuleList([nn.Embedding(rows, dim) for _ in range(tables)])
        self.head = nn.Linear(tables * dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, tables, L]
        pooled = [e(ids[:, t]).sum(1) for t, e in enumerate(self.emb)]
        return self.head(torch.cat(pooled, 1))


def _ms(fn, x: torch.Tensor) -> float:
    with torch.no_grad():
        fn(x)
        t0 = time.perf_counter()
        for _ in range(10):
            fn(x)
    return 1e3 * (time.perf_counter() - t0) / 10


def main() -> None:
    torch.manual_seed(0)
    m = Tables().eval()
    ids = torch.randint(0, 3000, (256, 8, 20))
    cap = capture(m, (ids,), method="fx")
    for rules, ex in ((["embedding.bag", "embedding.batched"], "exact"),
                      (["embedding.bag", "embedding.batched", "embedding.int8"], "approx")):  # fmt: skip
        plan = make_plan(cap, rules=rules, exactness=ex)
        for d in plan.decisions:
            if d.rule != "embedding.bag":
                print(f"{d.rule:18s} {d.site.description}")
        print(f"  ({sum(d.rule == 'embedding.bag' for d in plan.decisions)} bags)")
        applied = apply_plan(cap, plan)
        with torch.no_grad():
            ref, out = m(ids), applied.gm(ids)
        err = float((out - ref).norm() / ref.norm())
        print(f"  rel L2 vs the model: {err:.1e}; {_ms(m, ids):.2f} ms -> "
              f"{_ms(applied.gm, ids):.2f} ms a batch on this CPU")  # fmt: skip


if __name__ == "__main__":
    main()
