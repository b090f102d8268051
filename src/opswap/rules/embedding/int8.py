"""embedding.int8: an embedding bag's float table -> int8 rows with a float32 scale and
bias per row (value = q * scale + bias), read by opswap::batched_embedding_bag, which
dequantizes each row as it gathers it: a quarter of the table's bytes in memory and a
quarter of the row bytes each lookup reads (plus 8 bytes a row).

Approx: each element moves by at most half a step, (max - min) / 255 / 2 of its row; a
bag of L rows sums L such errors. The memory before and after is in the site's
description and record. Runs after embedding.batched (it quantizes the batched table).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from opswap.graph.ops import op_kind
from opswap.kernels.embedding_bag import quantize_rows
from opswap.rules._edits import drop_dead_attrs, erase, new_const
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.embedding import _install, _read
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class Int8(Rule):
    """float table -> int8 rows + scale and bias, dequantized in the kernel. Approx."""

    name = "embedding.int8"
    family = "embedding"
    chapter = 18
    exactness = "approx"
    after = ("embedding.batched", "embedding.bag")
    relieves = ("memory:embedding",)
    anchors = ("embedding_bag", _read.BATCHED)
    description = (
        "an embedding bag's float32/bf16/fp16 table -> int8 rows with a scale and bias per "
        "row, dequantized as opswap::batched_embedding_bag reads them: 1/4 of float32's "
        "bytes (memory before and after reported)."
    )
    #: the stored dtype and the bytes of per-row constants it needs
    store: torch.dtype = torch.int8
    per_row = 8

    def _convert(
        self, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return quantize_rows(table)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if op_kind(node) == _read.BATCHED:
            w = node.args[0]
            table = _read.table_of(gm, w) if isinstance(w, fx.Node) else None
            if node.args[5] is not None:
                return None  # quantized already
            whole = None
        else:
            got = _read.read_bag(gm, node)
            if got is None or isinstance(got, str):
                return Refused(got) if isinstance(got, str) else None
            whole, table = got, got.table
        if table is None:
            return Refused(f"the table of {node.name} is computed, not a weight")
        if not table.dtype.is_floating_point or table.dtype == self.store:
            return None
        rows, dim = table.shape
        before = _read.table_bytes(rows, dim, table.dtype)
        after = _read.table_bytes(rows, dim, self.store, self.per_row)
        return Found(
            whole.nodes if whole is not None else [node],
            f"table {rows} x {dim} {str(table.dtype).removeprefix('torch.')} "
            f"{_read.kib(before)} -> {str(self.store).removeprefix('torch.')} "
            f"{_read.kib(after)}",
            dict(bag=whole, table=table),
            outputs=[whole.out] if whole is not None else [node],
            record=dict(bytes_before=before, bytes_after=after, rows=rows, dim=dim),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        table: torch.Tensor = found["table"]
        converted = self._convert(table)
        bag: _read.Bag | None = found["bag"]
        anchor = found.nodes[0] if bag is None else bag.nodes[0]
        w = new_const(
            gm, anchor, "embedding_table_" + str(self.store).removeprefix("torch."), converted[0]
        )
        scale = bias = None
        sc, bi = converted[1], converted[2]
        if sc is not None and bi is not None:
            scale = new_const(gm, anchor, "embedding_scale", sc, as_param=False)
            bias = new_const(gm, anchor, "embedding_bias", bi, as_param=False)
        if bag is None:
            node = found.nodes[0]
            old = node.args[0]
            args = list(node.args)
            args[0], args[5], args[6], args[7] = w, scale, bias, table.dtype
            node.args = tuple(args)
            if isinstance(old, fx.Node):
                drop_dead_attrs(gm, [old])
            return
        offsets = torch.zeros(1, dtype=torch.int64, device=table.device)
        psw = [bag.psw] if bag.psw is not None else None
        (new,) = _install.batched_call(
            gm, bag.out, bag.out, w, offsets, [bag.idx], psw, bag.mean, scale, bias, table.dtype
        )
        _install.take_over(new, bag.out)
        erase(gm, bag.nodes)
        if isinstance(bag.weight, fx.Node):
            drop_dead_attrs(gm, [bag.weight])

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return _read.memory_estimate(found, target, least=1e-9)
