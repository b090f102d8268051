"""activation.silu_hardswish: SiLU -> Hardswish, MobileNetV3's substitution."""

from __future__ import annotations

import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.cost.pointwise import ACTIVATION_FLOPS
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import replace_with
from opswap.rules._matching import input_of
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

#: max |silu(x) - hardswish(x)| over x in [-20, 20] at steps of 1e-5, in float64: at
#: x = 3, where hardswish reaches x and silu(3) = 2.857; the same at x = -3
MAX_ABS_ERROR = 0.1423


@register
class SiluHardswish(Rule):
    """SiLU (x * sigmoid(x): nn.SiLU, F.silu, aten.silu) -> Hardswish
    (x * relu6(x + 3) / 6), the substitution MobileNetV3 made for its hardware:
    piecewise linear, no exp, cheap in int8 arithmetic without a lookup table.

    Lossy: over a dense float64 grid (x in [-20, 20], step 1e-5) the two differ by up to
    0.142 (at x = +-3), which changes what a network trained with SiLU computes; only
    fine-tuning, or a network that tolerates it, keeps the accuracy: the verification
    and the race decide.

    Where it pays: int8 and mobile hardware and runtimes (XNNPACK, NNAPI and other mobile
    delegates, int8 accelerators), where exp is costly or missing; opswap has no target
    for those yet. On a desktop CPU and on a GPU both are one memory-bound pass and the
    cost model predicts no gain (none is claimed: on this 2-core AVX2 machine the two
    took the same time on 8192 x 3072 float32, within noise).
    """

    name = "activation.silu_hardswish"
    family = "activation"
    chapter = 9
    exactness = "lossy"
    targets = ("cpu",)
    # x * sigmoid(x) becomes silu first, and SwiGLU's silu stays for its Triton kernel
    after = ("fusion.*", "activation.swiglu")
    # the SiLU that gelu_sigmoid makes stands for a GELU, not for a SiLU of the model's
    before = ("activation.gelu_sigmoid",)
    relieves = ("compute:activation",)
    anchors = ("silu",)
    description = (
        "SiLU -> Hardswish (lossy: max abs 0.14): piecewise linear, no exp, for int8 and "
        "mobile runtimes (MobileNetV3); no gain on desktop CPUs or GPUs."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        x = input_of(node)
        if x is None:
            return None
        xi = info(x)
        if xi is not None and not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is {xi.dtype}; SiLU takes floating-point tensors")
        return Found(
            (node,),
            f"{node.name}: SiLU -> Hardswish (max abs error {MAX_ABS_ERROR:.2f})",
            x=x,
            record=dict(silu=node.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        replace_with(gm, found.nodes[-1], "hardswish", (found["x"],))

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        silu = found.nodes[-1]
        i = info(silu)
        n = i.numel if i is not None else 0
        hsw = NodeCost(ACTIVATION_FLOPS["hardswish"] * n, node_cost(silu).bytes)
        return saving(
            target,
            [silu],
            [hsw],
            "one memory-bound pass either way; no exp, which pays on int8 and mobile "
            "runtimes, not modelled by this target",
        )
