"""Sequence and recommender zoo models: seq (LSTM + GRU) and recsys (embedding tables)."""

from __future__ import annotations

import torch
from torch import nn

from opswap.errors import SpecError
from opswap.models._common import positive, seeded

# --------------------------------------------------------------------------- seq


class RecurrentClassifier(nn.Module):
    def __init__(self, features: int, hidden: int, num_classes: int):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lstm(x)[0]  # h: [B, T, hidden]
        h = self.gru(h)[0]
        return self.head(h[:, -1])


def seq_model(
    batch: int = 4,
    seq: int = 20,
    features: int = 16,
    hidden: int = 32,
    num_classes: int = 5,
    seed: int = 0,
):
    """Recurrent classifier on [batch, seq, features] (chapter 19).

    Patterns: an nn.LSTM and an nn.GRU (batch_first, one layer each; fused-cell and
    RNN -> Transformer targets), the last time step taken with x[:, -1], a Linear head.
    """
    positive(
        "zoo:seq", batch=batch, seq=seq, features=features, hidden=hidden, num_classes=num_classes
    )
    with seeded(seed):
        model = RecurrentClassifier(features, hidden, num_classes)
        return model.eval(), (torch.randn(batch, seq, features),)


# --------------------------------------------------------------------------- recsys


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for cin, cout in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(cin, cout), nn.ReLU()]
    return nn.Sequential(*layers)


class Recommender(nn.Module):
    """Two one-hot tables, two multi-hot bag tables, a dense-feature MLP, and a top MLP."""

    def __init__(
        self,
        users: int,
        items: int,
        categories: int,
        tags: int,
        embedding_dim: int,
        bag_dim: int,
        dense_features: int,
        bag_tables: int = 0,
    ):
        super().__init__()
        self.user = nn.Embedding(users, embedding_dim)
        self.item = nn.Embedding(items, embedding_dim)
        self.category = nn.Embedding(categories, bag_dim)
        self.tag = nn.Embedding(tags, bag_dim)
        # more multi-hot tables, summed like `tag` over bags of its length (chapter 18's
        # embedding.batched looks them up together with it)
        self.bags = nn.ModuleList([nn.Embedding(tags, bag_dim) for _ in range(bag_tables)])
        self.bottom = _mlp([dense_features, 64, embedding_dim])
        top_in = 3 * embedding_dim + (2 + bag_tables) * bag_dim
        self.top = nn.Sequential(_mlp([top_in, 64, 32]), nn.Linear(32, 1))

    def forward(
        self,
        user_ids: torch.Tensor,
        item_ids: torch.Tensor,
        category_bags: torch.Tensor,
        tag_bags: torch.Tensor,
        dense: torch.Tensor,
        more_bags: torch.Tensor | None = None,
    ) -> torch.Tensor:
        u = self.user(user_ids)  # [B, E]
        i = self.item(item_ids)
        c = self.category(category_bags).mean(dim=1)  # [B, bag, E2] -> [B, E2]: mean bag
        t = self.tag(tag_bags).sum(dim=1)  # sum bag
        d = self.bottom(dense)
        more = (
            []
            if more_bags is None
            else [e(more_bags[:, j]).sum(dim=1) for j, e in enumerate(self.bags)]
        )
        z = torch.cat([u, i, c, t, *more, d], dim=1)
        return torch.sigmoid(self.top(z))  # [B, 1] click probability


def recsys(
    batch: int = 8,
    users: int = 5000,
    items: int = 4000,
    categories: int = 1000,
    tags: int = 2000,
    embedding_dim: int = 32,
    bag_dim: int = 16,
    category_bag: int = 4,
    tag_bag: int = 8,
    dense_features: int = 13,
    bag_tables: int = 0,
    seed: int = 0,
):
    """DLRM-style click-through model (chapter 18).

    Inputs: user ids [B], item ids [B], category bags [B, category_bag], tag bags
    [B, tag_bag] (int64) and dense features [B, dense_features] (float).
    Patterns: four nn.Embedding tables (1000-5000 rows, 16-32 wide); two
    multi-hot bags written as embedding followed by .mean(dim=1) and by
    .sum(dim=1) (EmbeddingBag targets); with bag_tables > 0, that many more multi-hot
    tables (`tags` rows, bag_dim wide) summed over bags of tag_bag, from one more input
    [B, bag_tables, tag_bag] (with the tag table: one table-batched lookup); a dense-feature MLP (Linear+ReLU); cat of
    all features; a top MLP with ReLU; sigmoid output.
    """
    positive(
        "zoo:recsys",
        batch=batch,
        users=users,
        items=items,
        categories=categories,
        tags=tags,
        embedding_dim=embedding_dim,
        bag_dim=bag_dim,
        category_bag=category_bag,
        tag_bag=tag_bag,
        dense_features=dense_features,
    )
    if bag_tables < 0:
        raise SpecError(f"Override bag_tables for zoo:recsys must be at least 0, got {bag_tables}.")
    with seeded(seed):
        model = Recommender(
            users, items, categories, tags, embedding_dim, bag_dim, dense_features, bag_tables
        )
        inputs: tuple[torch.Tensor, ...] = (
            torch.randint(0, users, (batch,)),
            torch.randint(0, items, (batch,)),
            torch.randint(0, categories, (batch, category_bag)),
            torch.randint(0, tags, (batch, tag_bag)),
            torch.randn(batch, dense_features),
        )
        if bag_tables:
            inputs += (torch.randint(0, tags, (batch, bag_tables, tag_bag)),)
        return model.eval(), inputs
