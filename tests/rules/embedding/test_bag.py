"""embedding.bag: emb(idx).sum(1), .mean(1) and the weighted sum -> an embedding bag in
both capture flavours (F.embedding_bag in FX, the one-table opswap op in ATen), the padding
row still read, same numbers at other batch sizes and bag lengths; refuses a pooling over
another dim and one that keeps the bag dim; a max over the bag is not a candidate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ._models import Tables, fired, inputs, ops, plan

RULE = "embedding.bag"


@pytest.mark.parametrize("method", ["fx", "export"])
def test_bags_fire_and_keep_the_numbers(method):
    m = Tables().eval()
    p, applied = plan(m, inputs(), [RULE], method)
    assert len(fired(p, RULE)) == 5, (p.decisions, p.misses)
    kinds = sorted(d.site.description.split(" of ")[0] for d in fired(p, RULE))
    assert kinds == ["mean", "sum", "sum", "sum", "weighted sum"], kinds
    with torch.no_grad():
        for a, b in zip(m(*inputs(3, 7)), applied.gm(*inputs(3, 7)), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if method == "fx":
        assert ops(applied.gm, "embedding_bag") == 5
    else:
        assert ops(applied.gm, "batched_embedding_bag") == 5


class Near(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Embedding(30, 4)

    def forward(self, i):
        keep = self.f(i + 1).sum(1, keepdim=True)
        return keep, self.f(i).sum(2), self.f(i * 2).mean(-2)


def test_near_misses_say_why():
    p, _ = plan(Near().eval(), (torch.randint(0, 15, (3, 6)),), [RULE], "fx")
    assert len(fired(p, RULE)) == 1  # the mean over dim -2 (the bag)
    why = " | ".join(mi.reason for mi in p.misses if mi.rule == RULE)
    assert "keeps the bag dim" in why and "not the bag" in why, why
