"""embedding.hashed: an nn.Embedding of a huge vocabulary (at least `min_rows` ids) ->
the hashing trick into `1 / ratio` of the rows (HashedEmbedding, rules/embedding/
_compress.py): ids that collide share a row, which starts as the mean of their rows.

Lossy: colliding ids read the same vector, so the function changes; the site's record
gives the memory before and after, and `opswap.train.finetune_embedding.fine_tune`
trains the model back toward the original on sample inputs (tests/rules/embedding/
test_hashed.py measures the agreement with the original before and after).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.ops import module_of
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.embedding import _read
from opswap.rules.embedding._compress import HashedEmbedding
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class Hashed(Rule):
    """Huge nn.Embedding -> hashed into 1/ratio of the rows. Lossy."""

    name = "embedding.hashed"
    family = "embedding"
    chapter = 18
    exactness = "lossy"
    before = ("embedding.bag",)
    relieves = ("memory:embedding",)
    anchors = ("embedding",)
    description = (
        "nn.Embedding with a huge vocabulary -> the hashing trick into a quarter of the rows "
        "(colliding ids share a row, started at their mean); memory before and after reported."
    )
    #: the fewest ids a table needs for the rule to hash it, and the shrink factor
    min_rows = 100_000
    ratio = 4

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        mod = module_of(node)
        if type(mod) is not nn.Embedding:
            return None
        if mod.num_embeddings < self.min_rows:
            return Refused(
                f"{node.target} has {mod.num_embeddings} rows, fewer than the {self.min_rows} "
                "worth hashing"
            )
        if mod.max_norm is not None or mod.padding_idx is not None:
            return Refused(f"{node.target} renormalises rows or has a padding row to keep apart")
        rows, dim = mod.weight.shape
        buckets = rows // self.ratio
        before = _read.table_bytes(rows, dim, mod.weight.dtype)
        after = _read.table_bytes(buckets, dim, mod.weight.dtype)
        return _read.shrunk(
            node,
            f"{rows} ids hashed into {buckets} rows",
            before,
            after,
            dict(buckets=buckets),
            dict(rows=rows, buckets=buckets),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        def make(weight: torch.Tensor) -> HashedEmbedding:
            return HashedEmbedding.from_table(weight, found["buckets"])

        _read.swap_table(gm, found, make, "hashed_embedding")

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return _read.memory_estimate(found, target)
