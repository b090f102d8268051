"""embedding.bag: an embedding lookup pooled over its bag -> one embedding bag.

`emb(idx).sum(1)`, `emb(idx).mean(1)` and `(emb(idx) * w.unsqueeze(-1)).sum(1)` (per-sample
weights) for indices [B, L] write the gathered rows [B, L, D] and read them back to pool;
an embedding bag pools the rows as it gathers them and writes only [B, D]. In an FX
capture the rewrite is `F.embedding_bag(idx, weight, mode=..., per_sample_weights=w)`;
in a torch.export (ATen) capture, and for a weighted mean (which F.embedding_bag does not
take), it is a one-table opswap::batched_embedding_bag, the same computation.

Exact: the same terms summed in float32 (F.embedding_bag on the CPU) in another order.
`padding_idx` is not passed on: the lookup returns the padding row's weight like any other
row, and so does the bag (F.embedding_bag's padding_idx would drop it, and shorten a
mean's count). An empty bag (L = 0) is 0 in the bag and NaN in `.mean(1)`: the capture's
bag lengths are at least 1; a model fed empty bags keeps its lookup (exactness exact holds
for L >= 1 only, as the verification's shapes check).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from opswap.cost import NodeCost
from opswap.graph.ops import copy_meta, is_aten
from opswap.rules._cost import saving
from opswap.rules._edits import erase
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.embedding import _install, _read
from opswap.rules.registry import register
from opswap.targets.base import Target


def bag_cost(bag: _read.Bag, batch: int) -> NodeCost:
    """One pooled gather: B L rows of D read, B D written, the indices read."""
    elt = torch.empty((), dtype=bag.dtype).element_size()
    rows = batch * bag.length
    return NodeCost(rows * bag.dim, rows * bag.dim * elt + batch * bag.dim * elt + rows * 8)


@register
class Bag(Rule):
    """emb(idx).sum(1) / .mean(1) (weighted or not) -> embedding bag. Exact (summation order)."""

    name = "embedding.bag"
    family = "embedding"
    chapter = 18
    exactness = "exact"
    relieves = ("memory:embedding", "memory:reduction")
    anchors = ("sum", "mean")
    description = (
        "emb(idx).sum(1), .mean(1) and (emb(idx) * w[..., None]).sum(1) over bags [B, L] -> "
        "F.embedding_bag (one-table opswap::batched_embedding_bag in ATen graphs): the "
        "gathered rows are pooled as they are read, never written."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        bag = _read.read_pooled(gm, node)
        if bag is None or isinstance(bag, str):
            return Refused(bag) if isinstance(bag, str) else None
        if bag.length == 0:
            return Refused(f"{node.name} pools empty bags, where a bag's mean is 0, not NaN")
        xi = _read.info(bag.idx)
        batch = int(xi.shape[0]) if xi is not None else 1
        how = ("weighted " if bag.psw is not None else "") + ("mean" if bag.mean else "sum")
        return Found(
            bag.nodes,
            f"{how} of {bag.length} rows of {bag.dim} from {bag.idx.name} -> embedding bag",
            dict(bag=bag, batch=batch),
            record=dict(idx=bag.idx.name, mean=bag.mean, weighted=bag.psw is not None),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        bag: _read.Bag = found["bag"]
        g, out = gm.graph, bag.out
        w = _install.weight_node(gm, bag.weight, bag.nodes[0])
        if is_aten(out) or (bag.mean and bag.psw is not None):
            dev = bag.table.device if bag.table is not None else torch.device("cpu")
            offsets = torch.zeros(1, dtype=torch.int64, device=dev)
            psw = [bag.psw] if bag.psw is not None else None
            (new,) = _install.batched_call(gm, out, out, w, offsets, [bag.idx], psw, bag.mean)
        else:
            with g.inserting_before(out):
                new = g.call_function(
                    F.embedding_bag,
                    (bag.idx, w),
                    {"mode": "mean" if bag.mean else "sum", "per_sample_weights": bag.psw},
                )
        copy_meta(new, out)
        out.replace_all_uses_with(new)
        erase(gm, bag.nodes)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        bag: _read.Bag = found["bag"]
        return saving(
            target,
            bag.nodes,
            [bag_cost(bag, found["batch"])],
            f"[B, {bag.length}, {bag.dim}] rows never written",
        )
