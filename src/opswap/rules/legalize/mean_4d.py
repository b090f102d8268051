"""legalize.mean_4d: mean over the last dim of a 2-D or 3-D tensor -> the 4-D mean over the
last two dims, the only mean XNNPACK delegates (global average pooling)."""

from __future__ import annotations

import torch.fx as fx

from opswap.graph.ops import arg, copy_meta
from opswap.rules._edits import call, replace_with
from opswap.rules._matching import setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.legalize._base import Legalize, reduced
from opswap.rules.legalize._mean import mean_last
from opswap.rules.registry import register
from opswap.targets.base import Target


def _dims(node: fx.Node) -> list[int] | None:
    d = arg(node, 1, "dim")
    if isinstance(d, int):
        return [d]
    if isinstance(d, (list, tuple)) and all(isinstance(x, int) for x in d):
        return list(d)
    return None


@register
class Mean4d(Legalize):
    """x.mean(-1) of x [N, H] or [B, S, H] written as the 4-D mean XNNPACK takes:

        [N, H] -> [N, H, 1, 1] -permute-> [1, N, H, 1];  [B, S, H] -unsqueeze(-1)-> [B, S, H, 1] -mean((2, 3), keepdim)-> [B, S, 1, 1]
                  -flatten-> [B, S, 1] (keepdim) or [B, S]

    and a global average pool written as x.mean((2, 3)) of x [B, C, H, W] as the same mean
    with keepdim, then flattened to [B, C].

    Exact (the same sum over H; its order is the kernel's). ExecuTorch's XNNPACK
    partitioner takes mean.dim only on a 4-D input over dims (2, 3) with keepdim
    (MeanDimConfig), so a LayerNorm or RMSNorm written out, and a decomposed one, leaves
    its means on the portable kernels, splitting the delegate around every norm."""

    name = "legalize.mean_4d"
    relieves = ("delegation:reduce",)
    anchors = ("mean",)
    after = ("pooling.*",)
    description = (
        "mean over the last dim of a 2-D/3-D tensor -> 4-D mean over dims (2, 3) with "
        "keepdim, the mean XNNPACK delegates (global average pooling)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        dims = _dims(node)
        got = reduced(node, dims, "dims")
        if not isinstance(got, tuple):
            return got
        x, xi = got
        assert dims is not None
        rank = len(xi.shape)
        keep = setting(node, "keepdim", False)
        if not isinstance(keep, bool):
            return Refused(f"keepdim of {node.name} is not a constant")
        norm = sorted(d % rank for d in dims) if rank else []
        if rank == 4 and norm == [2, 3] and keep:
            return None  # already the form the delegate takes
        pooled = rank == 4 and norm == [2, 3]  # global average pooling without keepdim
        if not pooled and (rank not in (2, 3) or norm != [rank - 1]):
            return Refused(
                f"{node.name} averages dims {norm} of a rank-{rank} tensor; only a mean over "
                "the last dim of a 2-D or 3-D tensor (or dims 2 and 3 of a 4-D one) is "
                "rewritten into the 4-D form"
            )
        if not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is {xi.dtype}; the delegate averages floats")
        return Found(
            (node,),
            f"{node.name}: mean over the last dim of {x.name} {list(xi.shape)} -> 4-D mean "
            "over dims (2, 3)",
            dict(x=x, rank=rank, keepdim=keep, hidden=int(xi.shape[-1])),
            record=dict(x=x.name, rank=rank, keepdim=keep),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, x, rank = found.nodes[0], found["x"], found["rank"]
        if rank == 4:  # [B, C, H, W] -> [B, C, 1, 1] -> [B, C]
            with gm.graph.inserting_before(node):
                m = call(gm.graph, node, "mean.dim", (x, [2, 3], True))
            replace_with(gm, node, "flatten.using_ints", (m, 1))
            return
        with gm.graph.inserting_before(node):
            m = mean_last(gm.graph, node, x, rank)  # keepdim: [.., 1]
        if found["keepdim"]:
            node.replace_all_uses_with(m)
            copy_meta(m, node)
            gm.graph.erase_node(node)
        else:
            replace_with(gm, node, "flatten.using_ints", (m, rank - 2))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return Estimate(note="legalisation: the mean moves into the delegate (no saving here)")
