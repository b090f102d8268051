"""activation.gelu_sigmoid: Linear -> GELU -> Linear becomes Linear -> SiLU -> Linear with
the 1.702 of "quick GELU", x * sigmoid(1.702 x), folded into the two Linears."""

from __future__ import annotations

import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.cost.pointwise import ACTIVATION_FLOPS
from opswap.graph.ops import op_kind
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import replace_weights, replace_with
from opswap.rules._matching import input_of, shared_reason
from opswap.rules._weights import Weighted, weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

#: the constant of x * sigmoid(1.702 x) (Hendrycks and Gimpel's sigmoid approximation)
ALPHA = 1.702
#: max |gelu(x) - x sigmoid(1.702 x)| over x in [-20, 20] at steps of 1e-5, in float64
#: (at x = -2.27; 2.07e-2 against the tanh form, at x = -2.29)
MAX_ABS_ERROR = 2.034e-2


def _linear(gm: fx.GraphModule, node: fx.Node) -> Weighted | str | None:
    """The weights of a Linear node, why they cannot be read, or None for another op."""
    return weighted(gm, node) if op_kind(node) == "linear" else None


@register
class GeluSigmoid(Rule):
    """GELU -> x * sigmoid(1.702 x) ("quick GELU"), between two Linears, spelled so that
    it is one kernel: 1.702 x = linear(h, 1.702 W1, 1.702 b1), and

        x * sigmoid(1.702 x) = silu(1.702 x) / 1.702,

    the 1 / 1.702 folded into the next Linear's weight. What runs is Linear -> SiLU ->
    Linear, the weights scaled once at rewrite time.

    Lossy: over a dense float64 grid (x in [-20, 20], step 1e-5) x sigmoid(1.702 x)
    differs from erf-GELU by at most 2.03e-2 (at x = -2.27) and from tanh-GELU by at most
    2.07e-2: forty times the tanh form's error, a change of the function that a model
    trained with GELU may or may not tolerate (CLIP was trained with this form); the
    verification and the race decide. Written out, x * sigmoid(1.702 x) is three kernels
    where GELU is one, so the rule refuses a GELU that is not between two Linears it can
    fold the scale into.

    Where it pays: SiLU is a sigmoid and a product, with no erf. On a GPU and on a
    desktop CPU both are one memory-bound pass and the cost model predicts no gain
    (none is claimed); it pays on hardware and runtimes that have a fast or fused
    sigmoid and no erf (int8 accelerators, mobile delegates), which opswap has no
    target for yet. Hence cpu as its target, and the race to keep it or not.
    """

    name = "activation.gelu_sigmoid"
    family = "activation"
    chapter = 9
    exactness = "lossy"
    targets = ("cpu",)
    after = ("fusion.*", "activation.gelu_tanh")
    relieves = ("compute:activation",)
    anchors = ("gelu",)
    description = (
        "Linear-GELU-Linear -> Linear-SiLU-Linear with quick GELU's 1.702 folded into the "
        "weights (lossy: max abs 2.0e-2); no erf, for int8/mobile runtimes."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        before = input_of(node)
        if before is None:
            return None
        xi = info(before)
        if xi is not None and not xi.dtype.is_floating_point:
            return Refused(f"{before.name} is {xi.dtype}; GELU takes floating-point tensors")
        readers = list(node.users)
        if len(readers) != 1 or input_of(readers[0]) is not node:
            names = ", ".join(u.name for u in readers[:3]) or "nothing"
            return Refused(
                f"{node.name} is read by {names}, not by one Linear that can take the "
                "1 / 1.702; written out, x * sigmoid(1.702 x) is three kernels where GELU is one"
            )
        after = readers[0]
        for other, w, where in (
            (before, _linear(gm, before), "reads"),
            (after, _linear(gm, after), "is read by"),
        ):
            if w is None:
                return Refused(
                    f"{node.name} {where} {other.name} ({op_kind(other)}), not a Linear whose "
                    "weights can take the 1.702 scale"
                )
            if isinstance(w, str):
                return Refused(f"{w}, so the 1.702 scale cannot be folded into it")
        w1, w2 = _linear(gm, before), _linear(gm, after)
        assert isinstance(w1, Weighted) and isinstance(w2, Weighted)
        if w1.module is not None and w1.module is w2.module:
            return Refused(f"{before.name} and {after.name} are the same Linear module")
        shared = shared_reason(before, {node}, "its weights cannot be scaled for the GELU")
        if shared:
            return Refused(shared)
        return Found(
            (before, node, after),
            f"{before.name} -> {node.name} -> {after.name}: GELU -> SiLU with 1.702 folded "
            f"into the Linears (quick GELU, max abs error {MAX_ABS_ERROR:.1e})",
            dict(w1=w1, w2=w2),
            record=dict(gelu=node.name, before=before.name, after=after.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        w1, w2 = found["w1"], found["w2"]
        gelu = found.nodes[1]
        b1 = None if w1.bias is None else w1.bias.detach() * ALPHA
        first = replace_weights(gm, w1, w1.weight.detach() * ALPHA, b1)
        replace_with(gm, gelu, "silu", (first,))
        b2 = None if w2.bias is None else w2.bias.detach().clone()
        replace_weights(gm, w2, w2.weight.detach() / ALPHA, b2)

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        gelu = found.nodes[1]
        i = info(gelu)
        n = i.numel if i is not None else 0
        silu = NodeCost(ACTIVATION_FLOPS["silu"] * n, node_cost(gelu).bytes)
        return saving(
            target,
            [gelu],
            [silu],
            "GELU -> SiLU: one pass either way; no erf, which pays where erf is slow or "
            "missing (int8 and mobile runtimes), not modelled by this target",
        )
