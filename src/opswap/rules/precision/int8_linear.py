"""precision.int8_linear: a float32 Linear -> int8 weights and dynamically quantised int8
inputs, with an int32-accumulating integer GEMM (`opswap::int8_linear`)."""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.fx as fx

from opswap.cost import NodeCost, node_cost
from opswap.graph.ops import module_of
from opswap.graph.shapes import info
from opswap.rules._cost import op_time
from opswap.rules._matching import input_of
from opswap.rules._weights import weighted
from opswap.rules.base import Estimate, Found, Refused, Rule
from opswap.rules.precision import _lowbit as lb
from opswap.rules.precision._int8_module import Int8Linear
from opswap.rules.registry import register
from opswap.targets.base import Target, Timer

#: below this many input features the quantise/rescale passes cost more than the GEMM saves
MIN_IN_FEATURES = 64
MIN_OUT_FEATURES = 16
#: below this many rows (batch x tokens at the example shape) the ~10 small ops around the
#: GEMM cost more than it saves (measured: 1 row of 768 -> 768 ran at 0.57x float32's speed)
MIN_ROWS = 8


def _passes(m: int, k: int, n: int) -> list[NodeCost]:
    """The elementwise work around the integer GEMM, op by op as the kernel runs it (each
    reads and writes float32 unless noted): |x|, row max, x / s, round, clamp, to int8
    (writes 1 byte), then int32 -> float32, two scale multiplies and the bias add."""
    mk, mn = m * k, m * n
    return [
        NodeCost(mk, 8 * mk),
        NodeCost(mk, 4 * mk + 4 * m),
        NodeCost(mk, 8 * mk),
        NodeCost(mk, 8 * mk),
        NodeCost(mk, 8 * mk),
        NodeCost(0, 5 * mk),
        NodeCost(0, 8 * mn),
        NodeCost(mn, 8 * mn),
        NodeCost(mn, 8 * mn),
        NodeCost(mn, 8 * mn),
    ]


def cpu_kernel() -> str:
    """The int8 GEMM Int8Linear runs on this CPU: `torch._int_mm` where it has an int8
    kernel (VNNI or AMX), else FBGEMM's AVX2 kernel where this torch has it, else
    `_int_mm`'s slow path (which the timing then refuses)."""
    from opswap.kernels import int8_fbgemm
    from opswap.kernels.int8_linear import cpu_int_mm_fast

    if cpu_int_mm_fast() or not int8_fbgemm.available():
        return "int_mm"
    return "fbgemm"


@lru_cache(maxsize=256)
def time_on_this_cpu(
    m: int, k: int, n: int, bias: bool, threads: int, timer: Timer, kernel: str = "int_mm"
) -> tuple[float, float]:
    """(float32 Linear, Int8Linear with `kernel`) seconds at this shape on this machine,
    by the target's `timer` (bench.timing.fastest: the fastest of interleaved rounds over
    about a tenth of a second). Cached per shape and thread count: a model with 48 such
    Linears has a handful of shapes."""
    g = torch.Generator().manual_seed(m * 31 + k * 7 + n)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    q = Int8Linear(w, b, kernel)
    with torch.inference_mode():
        res = timer({"float32": lambda: torch.nn.functional.linear(x, w, b), "int8": lambda: q(x)})
    return res["float32"], res["int8"]


def _is_this_cpu(target: Target) -> bool:
    """The measured target of the machine opswap runs on (not a datasheet or a test's)."""
    return getattr(target, "name", "") == "cpu" and getattr(target, "kind", "") == "cpu"


@register
class Int8DynamicLinear(Rule):
    """float32 Linear -> Int8Linear: weight quantised once to int8 per output channel,
    the input quantised to int8 per row on every call, the product accumulated in int32
    by `torch._int_mm` (oneDNN's VNNI/AMX kernels on x86) and rescaled in float32. On an
    x86 CPU without VNNI or AMX the product runs on FBGEMM's AVX2 kernel instead, with the
    input quantised per tensor in 7 bits (`cpu_kernel`; about 1.4% relative L2 per layer).

    Approximate: each layer's output moves by about 0.9% (relative L2) on random weights;
    the approx tolerance (cosine >= 0.999, relative L2 <= 3%) or the user's budget decides
    how many layers keep it, and bisection rolls back the ones that break it. It pays
    where the GEMM dominates: the weight moves a quarter of the bytes and the integer
    GEMM runs at the int8 rate; where the quantise and rescale passes cost more than that
    saves, the prediction says slower and the planner skips the site.

    The prediction for the `cpu` target (this machine) is a measurement: both layers timed
    at the site's shape (`time_on_this_cpu`), because the balance moves with the thread
    count more than a roofline follows (64 x 768 -> 768 ran 1.92x on 2 threads and 0.50x
    on 16, where the float32 GEMM scales and the small int8 one does not). For any other
    target it is the roofline estimate from its int8 and float32 rates.
    """

    name = "precision.int8_linear"
    family = "precision"
    chapter = 6
    exactness = "approx"
    targets = ("cpu",)
    after = ("fusion.*",)
    relieves = ("compute:matmul", "memory:matmul")
    description = (
        "float32 Linear -> int8 weights (per channel) and int8 inputs quantised per "
        "row at run time, int32-accumulated integer GEMM (approx: ~1% error per layer)."
    )

    anchors = ("linear",)

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | Refused | None:
        if isinstance(module_of(node), Int8Linear):
            return None
        w = weighted(gm, node)
        if isinstance(w, str):
            return Refused(w)
        if w.weight.dtype != torch.float32:
            dtype = str(w.weight.dtype).removeprefix("torch.")
            return Refused(
                f"{node.name}'s weight is {dtype}; int8 dynamic quantisation is "
                "offered for float32 layers"
            )
        n, k = w.weight.shape
        if k < MIN_IN_FEATURES or n < MIN_OUT_FEATURES:
            return Refused(
                f"{node.name} is {k} -> {n} features: below {MIN_IN_FEATURES} "
                f"inputs or {MIN_OUT_FEATURES} outputs the quantise and rescale "
                "passes cost more than the int8 GEMM saves"
            )
        x = input_of(node)
        xi = info(x) if x is not None else None
        if xi is None or xi.dtype != torch.float32:
            return Refused(f"the input of {node.name} is not a float32 tensor of known shape")
        rows = xi.numel // max(k, 1)
        if rows < MIN_ROWS:
            return Refused(
                f"{node.name} runs on {rows} row(s) at the example shape: below "
                f"{MIN_ROWS} rows the quantise and rescale ops around the int8 GEMM "
                "cost more than it saves"
            )
        kernel = cpu_kernel()
        how = "per row" if kernel == "int_mm" else "per tensor in 7 bits (FBGEMM)"
        return Found(
            (node,),
            f"{node.name} ({k} -> {n}) in int8, input quantised {how}",
            dict(w=w, kernel=kernel),
            record=dict(linear=node.name, kernel=kernel),
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node, w = found.nodes[0], found["w"]
        lb.install(gm, node, Int8Linear(w.weight, w.bias, found["kernel"]), "int8")

    def predict(self, gm: fx.GraphModule, found: Found, target: Target) -> Estimate:
        node, w = found.nodes[0], found["w"]
        out = info(node)
        if out is None:
            return Estimate(note="shape unknown: no prediction")
        n, k = w.weight.shape
        m = max(1, out.numel // n)
        before = node_cost(node)
        if _is_this_cpu(target) and getattr(target, "timer", None) is not None:
            kernel = found["kernel"]
            t32, t8 = time_on_this_cpu(
                m, k, n, w.bias is not None, torch.get_num_threads(), target.timer, kernel
            )
            return Estimate(
                0.0,
                float(3 * k * n),
                t32 - t8,
                f"timed at {m} x {k} -> {n} on this CPU: float32 {t32 * 1e6:.0f} us, "
                f"int8 ({kernel}) {t8 * 1e6:.0f} us",
            )
        gemm = NodeCost(
            2 * m * k * n, m * k + k * n + 4 * m * n + (4 * n if w.bias is not None else 0)
        )
        t_before = op_time(before, target, "float32")
        t_after = op_time(gemm, target, "int8") + sum(
            op_time(c, target, "float32") for c in _passes(m, k, n)
        )
        added = gemm.bytes + sum(c.bytes for c in _passes(m, k, n))
        return Estimate(
            0.0,
            float(before.bytes - added),
            t_before - t_after,
            f"int8 GEMM at the target's int8 rate, weight bytes / 4, plus "
            f"10 quantise/rescale passes over {m} rows",
        )
