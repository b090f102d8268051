"""precision.fp8_linear: a bfloat16/float16 Linear on many rows -> FP8 e4m3 weights and
activations with row-wise scales, through `torch._scaled_mm` (`opswap::fp8_linear`)."""

from __future__ import annotations

import torch.fx as fx

from opswap.cost import NodeCost
from opswap.kernels import fp8_linear as fp8
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision import _lowbit as lb
from opswap.rules.precision._lowbit_modules import FP8Linear
from opswap.rules.registry import register
from opswap.targets.base import Target

#: below this many rows the GEMM is memory-bound and FP8's doubled rate buys nothing,
#: while the activation's quantisation adds a kernel (the issue's H200 measurement:
#: FP8 slower than bfloat16 at 1 and 16 rows)
MIN_ROWS = 128


@register
class FP8LinearRule(Rule):
    """FP8 doubles the tensor-core rate of a compute-bound GEMM. Approximate: e4m3 keeps 3
    mantissa bits, and a layer's output moves by about 3-4% (relative L2) on random data,
    at the edge of the approx tolerance: verification and bisection decide per site."""

    name = "precision.fp8_linear"
    family = "precision"
    chapter = 6
    exactness = "approx"
    targets = ("cuda",)
    after = ("fusion.*", "precision.*_weight_only")
    relieves = ("compute:matmul",)
    anchors = ("linear",)
    description = (
        "bfloat16 Linear on >= 128 rows (prefill) -> FP8 e4m3 weights and per-token "
        "activations, row-wise scales, torch._scaled_mm (approx: ~3% error per layer)."
    )

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        site = lb.read_site(node, gm, "FP8")
        if not isinstance(site, lb.LinearSite):
            return site
        why = fp8.fp8_supported(site.w.weight.device) or fp8.shape_supported(site.k, site.n)
        if why:
            return Refused(why)
        if site.rows < MIN_ROWS:
            return Refused(
                f"{node.name} runs on {site.rows} rows at the example shape: below "
                f"{MIN_ROWS} rows the GEMM is memory-bound, FP8's tensor-core rate buys "
                "nothing and quantising the input costs a kernel"
            )
        return lb.found(node, site, f"{node.name} ({site.k} -> {site.n}) in FP8, row-wise scales")

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, w = found.nodes[0], found["w"]
        lb.install(gm, node, FP8Linear(w.weight, w.bias, rowwise=True), "fp8")

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        w, m = found["w"], max(1, found["rows"])
        n, k = w.weight.shape
        bias = w.bias is not None
        before = lb.bf16_gemm(m, k, n, bias)
        quant = NodeCost(3 * m * k, 2 * m * k + m * k + 4 * m)  # read bf16, write e4m3 + scale
        gemm = NodeCost(2 * m * k * n, m * k + k * n + 2 * m * n + (2 * n if bias else 0))
        t0 = lb.time_of([before], target, "bfloat16")
        t1 = lb.time_of([quant], target, "bfloat16") + lb.time_of([gemm], target, "float8")
        return Estimate(
            0.0,
            float(before.bytes - quant.bytes - gemm.bytes),
            t0 - t1,
            f"GEMM at the FP8 rate plus one quantisation pass over {m} x {k}",
        )
