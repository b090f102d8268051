"""topk.approx: torch.topk over the last dim -> `opswap::approx_topk`, the bucketed top-k:
the row split into B contiguous buckets, the top k' of each (a max per bucket when k' is
1, else one short top-k per bucket, all buckets at once), then the exact top-k of the B * k' survivors. A true top-k element is
lost only when more than k' of the k fall into its bucket.

Approx: the values returned are real values of the row, sorted, but some of the true
top-k may be missing (recall@k < 1). B and k' are chosen so that the expected recall on
exchangeable rows is at least the budget (`RECALL`, 0.95; kernels/topk.py `buckets_for`),
and the check measures it on random rows of the site's shape before it accepts the site:
the measured recall is in the site's description and record, and a site whose measured
recall falls under the budget is refused. Rows whose largest values cluster in one bucket
(a sorted row puts its whole top-k in the last bucket) do worse:
that is why the rule is not exact. On a CPU it was measured slower than torch.topk, and the
planner skips it there with that reason. A row length the buckets do not divide (a dynamic
length at another size) takes the exact top-k at run time.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.kernels import topk as T
from opswap.rules._cost import saving
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.rules.topk import _read
from opswap.rules.topk.topk import read_topk
from opswap.targets.base import Target

#: rows drawn to measure a site's recall
_SAMPLE_ROWS = 64


def measured_recall(n: int, k: int, largest: bool, buckets: int, per_bucket: int) -> float:
    """recall@k of the bucketed top-k on random normal rows of n (seeded): the share of the
    true top-k indices it returns."""
    g = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(_SAMPLE_ROWS, n, generator=g)
    _, got = T.approx_reference(x, k, largest, buckets, per_bucket)
    _, want = torch.topk(x, k, largest=largest)
    hit = torch.zeros(_SAMPLE_ROWS, n, dtype=torch.bool).scatter_(1, want, True)
    return float(hit.gather(1, got).float().mean())


@register
class ApproxTopK(Rule):
    """torch.topk -> bucketed approximate top-k, held to recall@k >= RECALL (approx)."""

    name = "topk.approx"
    family = "topk"
    chapter = 17
    exactness = "approx"
    targets = ("cuda", "cpu")
    after = ("topk.sort_slice",)
    relieves = ("compute:reduction", "memory:reduction")
    anchors = ("topk",)
    description = (
        "torch.topk over the last dim -> opswap::approx_topk: top-k' of B contiguous buckets, "
        "then the exact top-k of the survivors, with B and k' held to recall@k >= 0.95."
    )
    #: the recall@k a site must reach on random rows
    recall = T.RECALL

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        got = read_topk(node)
        if got is None or isinstance(got, str):
            return Refused(got) if isinstance(got, str) else None
        x, k, n, rows, largest, _ = got
        b, kp = T.buckets_for(n, k, self.recall)
        if b == 1:
            return Refused(
                f"no split of a row of {n} into buckets keeps recall@{k} >= {self.recall}"
            )
        r = measured_recall(n, k, largest, b, kp)
        if r < self.recall:
            return Refused(f"recall@{k} measured {r:.3f} on random rows, under {self.recall}")
        return Found(
            [node],
            f"topk({k}) of {x.name} over {n} -> {b} buckets x top {kp}, then top {k}: "
            f"recall@{k} {r:.3f} on random rows",
            dict(x=x, k=k, largest=largest, buckets=b, per_bucket=kp),
            record=dict(x=x.name, k=k, n=n, buckets=b, per_bucket=kp, recall=round(r, 4)),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        f = found
        args = (f["x"], f["k"], f["largest"], f["buckets"], f["per_bucket"])
        _read.replace_pair(gm, f.nodes[0], torch.ops.opswap.approx_topk.default, args)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        note = f"{found['buckets']} buckets of top {found['per_bucket']}"
        if getattr(target, "kind", "cpu") != "cuda":
            # benchmarks/results/topk_cpu.json: 0.17-0.56x torch.topk at n 4096-131072
            return Estimate(0.0, 0.0, -1e-9, f"{note}: measured slower than torch.topk on a CPU")
        return saving(target, [], [], f"{note}; not measured on a GPU yet")
