"""legalize.log_softmax: log_softmax over the last dim of a 2-D or 3-D tensor -> written out
with the 4-D max and mean, exp, log and subtractions XNNPACK delegates (it has no
log_softmax)."""

from __future__ import annotations

import math

import torch.fx as fx

from opswap.graph.shapes import dynamic_dims
from opswap.rules._edits import call, replace_with
from opswap.rules._matching import setting
from opswap.rules.base import Estimate, Found, Refused
from opswap.rules.legalize._base import Legalize, reduced
from opswap.rules.legalize._mean import max_last, mean_last
from opswap.rules.registry import register
from opswap.targets.base import Target


@register
class LogSoftmax(Legalize):
    """log_softmax(x, -1) -> s - log(mean(exp(s))) - log(N), s = x - max(x).

    Exact in math: log(sum(exp(s))) = log(mean(exp(s))) + log(N), and the shift by the max
    keeps exp from overflowing, as the op's own kernel does. XNNPACK has softmax and log
    but no log_softmax, and log(softmax(x)) would underflow to -inf where log_softmax is
    finite; so the stable form is written out with the 4-D max and mean it takes. Runs
    after fusion.log_softmax, which gathers a written-out log(softmax) into the op."""

    name = "legalize.log_softmax"
    relieves = ("delegation:softmax",)
    anchors = ("log_softmax",)
    after = ("fusion.log_softmax",)
    description = (
        "log_softmax over the last dim -> x - max - log(mean(exp(x - max))) - log(N), "
        "written with the 4-D max and mean XNNPACK delegates (it has no log_softmax)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        dim = setting(node, "dim", None)
        got = reduced(node, dim if isinstance(dim, int) else None, "dim")
        if not isinstance(got, tuple):
            return got
        x, xi = got
        assert isinstance(dim, int)
        rank = len(xi.shape)
        if rank not in (2, 3) or dim % rank != rank - 1:
            return Refused(
                f"{node.name} is over dim {dim} of a rank-{rank} tensor; only the last dim "
                "of a 2-D or 3-D tensor is written out"
            )
        if setting(node, "dtype", None) is not None or not xi.dtype.is_floating_point:
            return Refused(f"{node.name} converts its dtype; the written form keeps {xi.dtype}")
        if rank - 1 in dynamic_dims(x):
            return Refused(
                f"the last dim of {x.name} varies; log N is written as a constant of the "
                "written-out form"
            )
        n = int(xi.shape[-1])
        return Found(
            (node,),
            f"{node.name}: log_softmax of {x.name} over {n} written out for the delegate",
            dict(x=x, rank=rank, hidden=n),
            record=dict(x=x.name, hidden=n),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, x, rank, n, g = found.nodes[0], found["x"], found["rank"], found["hidden"], gm.graph
        with g.inserting_before(node):
            s = call(g, node, "sub.Tensor", (x, max_last(g, node, x, rank)))
            e = call(g, node, "exp", (s,))
            lse = call(g, node, "log", (mean_last(g, node, e, rank),))
            y = call(g, node, "sub.Tensor", (s, lse))
        replace_with(gm, node, "sub.Tensor", (y, math.log(n)))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        return Estimate(note="legalisation: log_softmax's ops move into the delegate")
