"""precision.int8_static_linear: a float32 Linear -> int8 weights and an int8 input whose
scale calibration fixed, computed by onednn's int8 GEMM (`opswap::int8_static_linear`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import arg, module_of
from opswap.graph.shapes import info
from opswap.kernels import int8_static
from opswap.rules._cost import op_time
from opswap.rules._edits import install_module, swap_in_module
from opswap.rules._matching import input_of
from opswap.rules._weights import weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision import _timing
from opswap.rules.precision._int8_static_module import NO_ONEDNN, Int8StaticLinear, calibrated
from opswap.rules.registry import register
from opswap.targets.base import Target, Timer

MIN_FEATURES = 16


@register
class StaticInt8Linear(Rule):
    """float32 Linear -> Int8StaticLinear: the weight in int8 per output channel (or per
    tensor), the input quantised to uint8 with the scale and zero point calibration
    chose for it (min-max, percentile, MSE or entropy over sample inputs), and the
    product by onednn's u8 x s8 GEMM with int32 accumulation.

    Approximate: a calibrated layer errs by about 1-2% (relative L2) on random weights,
    more where inputs at run time exceed the calibrated range (clipped). Against the
    dynamic scheme (precision.int8_linear) it saves the pass that finds each row's range
    and the quantise is one fused pass; it loses where one range does not fit all rows.
    On the `cpu` target the prediction is a measurement at the site's shape: on a CPU
    without VNNI the int8 GEMM is no faster than float32's, and the rule says so.
    """

    name = "precision.int8_static_linear"
    family = "precision"
    chapter = 6
    exactness = "approx"
    targets = ("cpu",)
    after = ("fusion.*",)
    relieves = ("compute:matmul", "memory:matmul")
    description = (
        "float32 Linear -> int8 weights and a uint8 input with a calibrated scale "
        "(static post-training quantisation), onednn's int8 GEMM."
    )

    anchors = ("linear",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if getattr(module_of(node), "opswap_kind", None) is not None:
            return None  # a layer opswap installed
        if not int8_static.onednn_available():
            return Refused(NO_ONEDNN)
        w = weighted(gm, node)
        if isinstance(w, str):
            return Refused(w)
        if w.weight.dtype != torch.float32 or w.weight.dim() != 2:
            return Refused(f"{node.name}'s weight is not a float32 matrix")
        n, k = w.weight.shape
        if k < MIN_FEATURES or n < MIN_FEATURES:
            return Refused(
                f"{node.name} is {k} -> {n} features: below {MIN_FEATURES} the quantise "
                "pass costs more than the int8 GEMM saves"
            )
        x = input_of(node)
        xi = info(x) if x is not None else None
        if x is None or xi is None or xi.dtype != torch.float32:
            return Refused(f"the input of {node.name} is not a float32 tensor of known shape")
        got = calibrated(gm, node, x)
        if isinstance(got, Refused):
            return got
        qp, cal = got
        return Found(
            (node,),
            f"{node.name} ({k} -> {n}) in int8, input scale {qp.scale:.3g} "
            f"zero point {qp.zero_point} ({cal.method})",
            dict(w=w, qp=qp, per_channel=cal.per_channel),
            record=dict(linear=node.name, **qp.to_json(), method=cal.method),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, w = found.nodes[0], found["w"]
        mod = Int8StaticLinear(w.weight, w.bias, found["qp"], found["per_channel"])
        if node.op == "call_module":
            install_module(gm, node, mod, str(node.target))
            return
        swap_in_module(
            gm, mod, (input_of(node),), node, [node], f"{node.name}_int8",
            home=arg(node, 1, "weight"),
        )  # fmt: skip

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        node, w = found.nodes[0], found["w"]
        out = info(node)
        if out is None:
            return Estimate(note="shape unknown: no prediction")
        n, k = w.weight.shape
        m = max(1, out.numel // n)
        if _timing.is_this_cpu(target):

            def make() -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
                g = torch.Generator().manual_seed(m * 31 + k * 7 + n)
                x = torch.randn(m, k, generator=g)
                wt = torch.randn(n, k, generator=g) / k**0.5
                b = torch.randn(n, generator=g) if w.bias is not None else None
                q = Int8StaticLinear(wt, b, found["qp"], True)
                return (lambda: torch.nn.functional.linear(x, wt, b)), (lambda: q(x))

            t32, t8 = _timing.timed_pair(
                ("static_linear", m, k, n, w.bias is not None),
                cast(Timer, target.timer),  # is_this_cpu: it is set
                make,
            )
            return Estimate(
                0.0,
                float(3 * k * n),
                t32 - t8,
                f"timed at {m} x {k} -> {n} on this CPU: float32 {t32 * 1e6:.0f} us, "
                f"int8 {t8 * 1e6:.0f} us",
            )
        before = node_cost(node)
        gemm = NodeCost(2 * m * k * n, m * k + k * n + 4 * m * n)
        quant = NodeCost(3 * m * k, 5 * m * k)
        t_after = op_time(gemm, target, "int8") + op_time(quant, target, "float32")
        return Estimate(
            0.0,
            float(before.bytes - gemm.bytes - quant.bytes),
            op_time(before, target, "float32") - t_after,
            "int8 GEMM at the target's int8 rate plus one quantise pass",
        )
