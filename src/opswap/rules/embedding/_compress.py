"""Smaller tables for huge vocabularies (lossy): the hashing trick and pruned rows, as the
modules the rules `embedding.hashed` and `embedding.pruned` install.

- `HashedEmbedding`: id -> ((id * a + b) mod p) mod M, a universal hash into M < V rows
  (p = 2^31 - 1); each new row starts as the mean of the original rows that hash to it,
  so the model starts near the original, and fine-tuning recovers the rest.
- `PrunedEmbedding`: only the rows used at least `min_count` times on sample data are kept;
  every other id reads one shared row, the mean of the dropped rows. `remap` (int32, 4
  bytes an id) says where each id's row went.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: the hash's prime modulus (2^31 - 1): ids below it hash without overflow in int64
PRIME = 2_147_483_647


def hash_ids(ids: torch.Tensor, mult: int, add: int, buckets: int) -> torch.Tensor:
    return ((ids * mult + add) % PRIME) % buckets


class HashedEmbedding(nn.Module):
    """An embedding of `vocab` ids in `weight.shape[0]` hashed rows."""

    opswap_kind = "embedding"

    def __init__(self, weight: torch.Tensor, vocab: int, mult: int, add: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab, self.mult, self.add = vocab, mult, add

    @classmethod
    def from_table(cls, table: torch.Tensor, buckets: int, seed: int = 0) -> HashedEmbedding:
        """Hash `table`'s ids into `buckets` rows, each the mean of the rows it takes."""
        g = torch.Generator().manual_seed(seed)
        mult = int(torch.randint(1, PRIME, (1,), generator=g))
        add = int(torch.randint(0, PRIME, (1,), generator=g))
        vocab = table.shape[0]
        h = hash_ids(torch.arange(vocab, device=table.device), mult, add, buckets)
        sums = torch.zeros(buckets, table.shape[1], dtype=table.dtype, device=table.device)
        sums.index_add_(0, h, table)
        count = torch.bincount(h, minlength=buckets).clamp_min(1).to(table.dtype)
        return cls(sums / count[:, None], vocab, mult, add)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(hash_ids(ids, self.mult, self.add, self.weight.shape[0]), self.weight)


class PrunedEmbedding(nn.Module):
    """An embedding that keeps some rows; the other ids share the last row."""

    opswap_kind = "embedding"

    def __init__(self, remap: torch.Tensor, weight: torch.Tensor) -> None:
        super().__init__()
        self.remap: torch.Tensor
        self.register_buffer("remap", remap.to(torch.int32))
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_usage(
        cls, table: torch.Tensor, counts: torch.Tensor, min_count: int
    ) -> PrunedEmbedding:
        """Keep the rows with `counts >= min_count`; the others share their mean."""
        keep = counts >= min_count
        kept = int(keep.sum())
        remap = torch.full((table.shape[0],), kept, dtype=torch.int32, device=table.device)
        remap[keep] = torch.arange(kept, dtype=torch.int32, device=table.device)
        rest = table[~keep]
        shared = rest.mean(0, keepdim=True) if len(rest) else torch.zeros_like(table[:1])
        return cls(remap, torch.cat([table[keep], shared]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.remap[ids].long(), self.weight)
