"""embedding.batched: after embedding.bag, the sum bags of width 8 of four tables (two
nn.Embedding, one with a padding_idx, one nn.EmbeddingBag) looked up from one batch
become one opswap::batched_embedding_bag over 124 rows in FX (three in ATen, where the
EmbeddingBag module is an aten op it does not read); the weighted and the width-6 mean
bags stay apart; same numbers at other shapes; a table computed at run time is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ._models import Tables, fired, inputs, ops, plan

RULE = "embedding.batched"


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tables_of_one_batch_become_one_launch(method):
    m = Tables().eval()
    p, applied = plan(m, inputs(), ["embedding.bag", RULE], method)
    (d,) = fired(p, RULE)
    want = 4 if method == "fx" else 3
    assert d.site.data["tables"] == want and d.site.data["dim"] == 8, d
    # 5 bags: one batched op for the group, the weighted and the mean bags alone
    assert ops(applied.gm, "batched_embedding_bag") == (1 if method == "fx" else 3)
    with torch.no_grad():
        for a, b in zip(m(*inputs(2, 9)), applied.gm(*inputs(2, 9)), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class Computed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(10, 4))
        self.b = nn.Parameter(torch.randn(10, 4))

    def forward(self, i, j):
        return torch.nn.functional.embedding_bag(i, self.a * 2, mode="sum") + (
            torch.nn.functional.embedding_bag(j, self.b, mode="sum")
        )


def test_a_computed_table_is_refused():
    p, _ = plan(Computed().eval(), (torch.randint(0, 10, (3, 4)),) * 2, [RULE], "fx")
    assert not fired(p, RULE)
    assert any("computed, not a weight" in mi.reason for mi in p.misses), p.misses


def test_the_zoo_recommender_with_more_bag_tables():
    from opswap.graph.capture import capture
    from opswap.models import load
    from opswap.planner import apply_plan, make_plan

    lm = load("zoo:recsys", {"bag_tables": "6"})
    cap = capture(lm.module, lm.example_inputs, method="fx")
    p = make_plan(cap, rules=["embedding.bag", RULE])
    (d,) = fired(p, RULE)
    assert d.site.data["tables"] == 7  # the tag table and the six more, bags of 8 x 16
    applied = apply_plan(cap, p)
    with torch.no_grad():
        want, got = lm.module(*lm.example_inputs), applied.gm(*lm.example_inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
