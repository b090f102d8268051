"""activation.gelu_tanh: GELU in its erf form -> GELU's tanh approximation."""

from __future__ import annotations

import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.cost.pointwise import ACTIVATION_FLOPS, gelu_tanh
from opswap.graph.ops import op_kind
from opswap.graph.shapes import info
from opswap.rules._cost import saving
from opswap.rules._edits import replace_with
from opswap.rules._matching import input_of
from opswap.rules.activation.linear_epilogue import epilogue_refusal
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.registry import register
from opswap.targets.base import Target

#: max |gelu(x) - gelu_tanh(x)| over x in [-20, 20] at steps of 1e-5, in float64
#: (at x = 2.699; the same in float32 to 4 digits): docs/chapters/09-activation.md
MAX_ABS_ERROR = 4.733e-4

CPU_NOTE = (
    "the tanh form saves nothing on its own, and on a CPU it costs more: on this 2-core "
    "AVX2 machine F.gelu(approximate='tanh') on 8192 x 3072 float32 took 1.9x the erf "
    "form's time (torch 2.13)"
)


@register
class GeluTanh(Rule):
    """GELU in its erf form (nn.GELU(), F.gelu(x), aten.gelu with approximate='none',
    transformers' GELUActivation, which calls F.gelu) -> F.gelu(x, approximate='tanh').

    Approximate: over a dense float64 grid (x in [-20, 20], step 1e-5) the two forms
    differ by at most 4.73e-4 (at x = 2.70), an absolute bound since both tend to x and
    to 0 at the ends; a network's output moves by that times what follows amplifies it.

    On its own it buys nothing: erf-GELU and tanh-GELU are each one memory-bound pass
    over the tensor (a GPU hides the arithmetic; a CPU without a fast tanh pays for it:
    slower here, see CPU_NOTE). What it buys is what the tanh form enables: it is the
    function cuBLASLt's GELU epilogue computes, so after it activation.linear_epilogue
    (declared to run after this rule) folds a Linear + GELU into one GEMM on CUDA; and
    it is the form several runtimes have a fused kernel for (ONNX Runtime's com.microsoft
    FastGelu computes it). The prediction says so: zero on a CUDA target where a
    Linear epilogue then takes it (that rule predicts the saving), slower on a CPU and
    where nothing takes it, so that the planner leaves it out there with the reason.
    """

    name = "activation.gelu_tanh"
    family = "activation"
    chapter = 9
    exactness = "approx"
    targets = ("cuda", "cpu")
    # a Linear made by matmul_add / linear_bn is what the epilogue folds it into
    after = ("fusion.*",)
    relieves = ("memory:activation",)
    anchors = ("gelu",)
    description = (
        "GELU (erf) -> tanh-GELU (approx: max abs 4.7e-4): no gain alone; it lets "
        "activation.linear_epilogue fold Linear + GELU into cuBLASLt's GELU epilogue (CUDA)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if gelu_tanh(node):
            return None  # already the tanh form
        x = input_of(node)
        if x is None:
            return None
        xi = info(x)
        if xi is not None and not xi.dtype.is_floating_point:
            return Refused(f"{x.name} is {xi.dtype}; GELU takes floating-point tensors")
        return Found(
            (node,),
            f"{node.name}: GELU (erf) -> tanh approximation (max abs error {MAX_ABS_ERROR:.1e})",
            x=x,
            record=dict(gelu=node.name),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        replace_with(gm, found.nodes[-1], "gelu", (found["x"],), {"approximate": "tanh"})

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        gelu = found.nodes[-1]
        x = found["x"]
        gi = info(gelu)
        n = gi.numel if gi is not None else 0
        tanh_cost = NodeCost(ACTIVATION_FLOPS["gelu_tanh"] * n, node_cost(gelu).bytes)
        est = saving(target, [gelu], [tanh_cost], "")
        if getattr(target, "kind", "cpu") != "cuda":
            return Estimate(0.0, 0.0, -max(abs(est.time_saved_s or 0.0), 1e-9), CPU_NOTE)
        folds = (
            op_kind(x) in ("linear", "addmm")
            and epilogue_refusal(gm, x, gelu, as_tanh=True) is None
        )
        if folds:
            return Estimate(
                0.0,
                0.0,
                0.0,
                f"no saving on its own; it lets activation.linear_epilogue fold {x.name} + "
                f"{gelu.name} into the GEMM's GELU epilogue, which predicts that saving",
            )
        return Estimate(
            0.0,
            0.0,
            -1e-9,
            "no saving on its own (erf and tanh GELU are each one memory-bound pass), and "
            "no Linear epilogue takes the tanh form here",
        )
