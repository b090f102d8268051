"""legalize.matmul_3d: a matmul of two rank-4 tensors [B, H, M, K] @ [B, H, K, N] -> one
rank-3 batched matmul over B * H, the bmm XNNPACK delegates."""

from __future__ import annotations

import torch.fx as fx

from opswap.graph.ops import arg
from opswap.graph.shapes import dynamic_dims, info
from opswap.rules._edits import call, replace_with
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.legalize._base import Legalize
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class Matmul3d(Legalize):
    """a @ b of rank-4 operands with the same leading dims, as attention's scores and
    context are written, -> bmm(a.flatten(0, 1), b.flatten(0, 1)).unflatten(0, (-1, H)).

    Exact (the same products and sums). torch.export writes a rank-4 matmul as
    expand -> view -> bmm -> view, and XNNPACK has no expand: each matmul leaves two copies
    on the portable kernels and splits the delegate around them. Flattened by hand there is
    nothing to expand. H (dim 1) must keep one size, since it is written into the unflatten;
    the batch dim B may vary."""

    name = "legalize.matmul_3d"
    relieves = ("delegation:matmul",)
    anchors = ("matmul",)
    description = (
        "rank-4 matmul with equal leading dims -> rank-3 bmm over the flattened batch and "
        "heads, with no expand copies (XNNPACK has no expand)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        a, b = arg(node, 0, "input"), arg(node, 1, "other")
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
            return None
        ai, bi = info(a), info(b)
        if ai is None or bi is None:
            return Refused(f"the shapes of {a.name} or {b.name} are unknown")
        if len(ai.shape) != 4 or len(bi.shape) != 4:
            return None  # only the rank-4 form is expanded by the export
        if tuple(ai.shape[:2]) != tuple(bi.shape[:2]):
            return Refused(
                f"{node.name} broadcasts {list(ai.shape[:2])} against {list(bi.shape[:2])} "
                "over the leading dims; only equal leading dims are flattened"
            )
        if 1 in dynamic_dims(a) or 1 in dynamic_dims(b):
            return Refused(f"dim 1 of {node.name}'s operands varies; it is written as a constant")
        heads = int(ai.shape[1])
        return Found(
            (node,),
            f"{node.name}: rank-4 matmul {list(ai.shape)} @ {list(bi.shape)} -> bmm over "
            f"batch x {heads}",
            dict(a=a, b=b, heads=heads),
            record=dict(a=a.name, b=b.name, heads=heads),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, g = found.nodes[0], gm.graph
        with g.inserting_before(node):
            a = call(g, node, "flatten.using_ints", (found["a"], 0, 1))
            b = call(g, node, "flatten.using_ints", (found["b"], 0, 1))
            m = call(g, node, "bmm", (a, b))
        replace_with(gm, node, "unflatten.int", (m, 0, [-1, found["heads"]]))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return Estimate(note="legalisation: no expand copies around the batched matmul")
