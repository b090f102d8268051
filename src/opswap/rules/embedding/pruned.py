"""embedding.pruned: an nn.Embedding whose ids come straight from a model input -> only the
rows its sample inputs use (the plan's calibration samples, graph/calibrate.py) at least
`min_count` times; every other id shares one row, the mean of the dropped ones
(PrunedEmbedding, rules/embedding/_compress.py).

Lossy: an id never seen in the samples reads the shared row. The site's record gives the
rows kept, the memory before and after (the kept rows plus 4 bytes an id for the remap),
and the description the same; `opswap.train.finetune_embedding.fine_tune` trains the
shared row and the rest back toward the original on sample inputs.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.calibrate import calibration_of
from opswap.graph.ops import module_of
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.embedding import _read
from opswap.rules.embedding._compress import PrunedEmbedding
from opswap.rules.registry import register
from opswap.targets.base import Target


def usage(gm: fx.GraphModule, ids: fx.Node, rows: int) -> torch.Tensor | str:
    """How often each row is read over the calibration samples, or why it cannot be told."""
    cal = calibration_of(gm)
    if cal is None or not cal.samples:
        return "no sample inputs to count the rows read (plan with calibration samples)"
    if ids.op != "placeholder":
        return f"the ids {ids.name} are computed in the model, not a model input"
    at = [n for n in gm.graph.nodes if n.op == "placeholder"].index(ids)
    counts = torch.zeros(rows, dtype=torch.int64)
    for sample in cal.samples:
        x = sample[at] if at < len(sample) else None
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int64, torch.int32):
            return f"sample input {at} is not a tensor of ids"
        counts += torch.bincount(x.flatten().cpu().long(), minlength=rows)[:rows]
    return counts


@register
class Pruned(Rule):
    """nn.Embedding -> the rows the samples use, the rest sharing one row. Lossy."""

    name = "embedding.pruned"
    family = "embedding"
    chapter = 18
    exactness = "lossy"
    before = ("embedding.bag",)
    after = ("embedding.hashed",)
    relieves = ("memory:embedding",)
    anchors = ("embedding",)
    description = (
        "nn.Embedding read by model-input ids -> only the rows the calibration samples use "
        "(the rest share their mean row); memory before and after reported."
    )
    #: a row is kept when the samples read it this often; a table keeping more than
    #: `max_kept` of its rows is left alone
    min_count = 1
    max_kept = 0.5

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        mod = module_of(node)
        if type(mod) is not nn.Embedding or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        rows, dim = mod.weight.shape
        counts = usage(gm, node.args[0], rows)
        if isinstance(counts, str):
            return Refused(counts)
        kept = int((counts >= self.min_count).sum())
        if kept > self.max_kept * rows:
            return Refused(
                f"the samples read {kept} of {node.target}'s {rows} rows; pruning keeps too "
                "many to pay"
            )
        before = _read.table_bytes(rows, dim, mod.weight.dtype)
        after = _read.table_bytes(kept + 1, dim, mod.weight.dtype) + 4 * rows
        return _read.shrunk(
            node,
            f"{kept} of {rows} rows read by the samples kept",
            before,
            after,
            dict(counts=counts),
            dict(rows=rows, kept=kept),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        def make(weight: torch.Tensor) -> PrunedEmbedding:
            return PrunedEmbedding.from_usage(weight, found["counts"], self.min_count)

        _read.swap_table(gm, found, make, "pruned_embedding")

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return _read.memory_estimate(found, target)
