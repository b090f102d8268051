"""embedding.half: an embedding bag's float32 table -> float16, read by
opswap::batched_embedding_bag, which converts each row to float32 as it gathers it and
sums in float32: half the table's bytes. Approx: each element rounds to float16 (relative
error <= 2^-11; a table with values past 65504 would overflow and is refused)."""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.rules.base import Found, Refused
from opswap.rules.embedding.int8 import Int8
from opswap.rules.registry import register


@register
class Half(Int8):
    """float32 table -> float16, upcast in the kernel. Approx."""

    name = "embedding.half"
    after = ("embedding.batched", "embedding.bag")
    description = (
        "an embedding bag's float32 table -> float16, converted to float32 as "
        "opswap::batched_embedding_bag reads it: half the bytes (memory before and after "
        "reported)."
    )
    store = torch.float16
    per_row = 0

    def _convert(
        self, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return (table.half(), None, None)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        got = super().check(gm, node)
        if isinstance(got, Found):
            table: torch.Tensor = got["table"]
            if table.dtype != torch.float32:
                return None
            if table.abs().max() > 65504:
                return Refused(f"the table of {node.name} holds values past float16's 65504")
        return got
