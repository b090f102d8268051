"""The one rule class behind precision.int8_weight_only and precision.int4_weight_only,
which differ in their bits, default groups, exactness and names (one file each)."""

from __future__ import annotations

from typing import ClassVar

import torch.fx as fx

from opswap.cost import NodeCost
from opswap.kernels import weight_only as wo
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision import _lowbit as lb
from opswap.rules.precision._lowbit_modules import WeightOnlyLinear
from opswap.targets.base import Target


def _weight_bytes(bits: int, k: int, n: int, group: int) -> int:
    kp = wo.padded_k(k, group)
    scales = (kp // group) * n * 4 * (2 if bits == 4 else 1)
    return kp * n * bits // 8 + scales


class WeightOnlyRule(Rule):
    """bfloat16/float16 Linear on few rows -> WeightOnlyLinear (opswap::wo_linear)."""

    family = "precision"
    chapter = 6
    targets = ("cuda",)
    after = ("fusion.*",)
    relieves = ("memory:matmul",)
    anchors = ("linear",)
    bits: ClassVar[int]

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        scheme = f"INT{self.bits} weight-only"
        site = lb.read_site(node, gm, scheme)
        if not isinstance(site, lb.LinearSite):
            return site
        if wo.triton is None:
            return Refused(f"Triton is not installed, and {scheme} runs a Triton kernel")
        if site.rows > wo.TRITON_MAX_ROWS:
            return Refused(
                f"{node.name} runs on {site.rows} rows at the example shape: above "
                f"{wo.TRITON_MAX_ROWS} rows the layer is no longer memory-bound, and the "
                "weight-only op dequantises and calls cuBLAS, slower than bfloat16"
            )
        return lb.found(
            node, site, f"{node.name} ({site.k} -> {site.n}) with INT{self.bits} weights"
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, w = found.nodes[0], found["w"]
        mod = WeightOnlyLinear(w.weight, w.bias, self.bits)
        lb.install(gm, node, mod, f"int{self.bits}")

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        w, m = found["w"], max(1, found["rows"])
        n, k = w.weight.shape
        bias = w.bias is not None
        g = wo.default_group_size(self.bits, k)
        before = lb.bf16_gemm(m, k, n, bias)
        wbytes = _weight_bytes(self.bits, k, n, g)
        after = NodeCost(2 * m * k * n, 2 * m * k + wbytes + 2 * m * n + (2 * n if bias else 0))
        t0 = lb.time_of([before], target, "bfloat16")
        t1 = lb.time_of([after], target, "bfloat16")
        return Estimate(
            0.0,
            float(before.bytes - after.bytes),
            t0 - t1,
            f"weight {2 * k * n} -> {wbytes} bytes at {m} row(s), one kernel either way",
        )
