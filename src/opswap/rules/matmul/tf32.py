"""matmul.tf32: a float32 Linear / matmul / addmm site (+ activation)(+ residual) on an
Ampere or later CUDA target -> opswap::gemm with precision "tf32": the product on the TF32
tensor cores (inputs rounded to 10 mantissa bits, fp32 accumulate), the epilogue fused.

Why a swap and not torch.backends.cuda.matmul.allow_tf32: that flag is process-wide. Set
at import it changes every matmul of the user's other code; set and restored around the
optimized module's forward it is invisible to torch.compile and torch.export (a traced
graph does not record it) and races with other threads. The swap puts the precision on
the op, in the graph: it survives export, compile and the ONNX lowering (which computes
float32), and touches nothing else. Convolutions are not covered (cuDNN's TF32 is the
same flag): the conv rules own them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from opswap.kernels import crossover
from opswap.rules.base import Estimate, Found
from opswap.rules.matmul.gemm import CPU_REASON, Gemm, time_site
from opswap.rules.registry import register


def tensor_core_class(target: Any) -> str | None:
    """Why `target` has no TF32 tensor cores, or None when it has (sm80 and later)."""
    dev = crossover.device_class(target)
    if dev.startswith("sm") and dev[2:].isdigit() and int(dev[2:]) >= 80:
        return None
    return f"TF32 tensor cores start at Ampere (sm80), and {getattr(target, 'name', dev)} is {dev}"


@register
class TF32(Gemm):
    """Float32 GEMMs on TF32 tensor cores. Approximate: the inputs lose 13 of float32's 23
    mantissa bits (unit roundoff 2^-11 = 4.9e-4), and a product's relative error grows to
    about 1e-3 (relative L2) on random data: within the approx tolerance, where exact
    float32 would not be. On a CPU the op multiplies in float32 (there is no TF32), so a
    candidate verified there is exact; the GPU test (tests/kernels/test_gemm.py) checks that
    the GPU product is TF32's. Chosen with the target's timer when it has one (cuBLAS's
    float32 product, as the user runs it, against ours in TF32), else by the roofline at
    the target's float32 and TF32 rates."""

    name = "matmul.tf32"
    exactness = "approx"
    before = ("matmul.gemm", "activation.linear_epilogue")
    after = ("fusion.*", "activation.gelu_tanh")
    relieves = ("compute:matmul",)
    description = (
        "float32 Linear/matmul/addmm (+ activation)(+ residual) -> opswap::gemm on TF32 "
        "tensor cores (Ampere+), epilogue fused (approx: ~1e-3 relative error)."
    )
    dtypes = (torch.float32,)
    precision = "tf32"

    def predict(self, gm: fx.GraphModule, found: Found, target: Any) -> Estimate:
        if getattr(target, "kind", "cpu") != "cuda":
            return Estimate(0.0, 0.0, -1e-9, CPU_REASON)
        why = tensor_core_class(target)
        if why is not None:
            return Estimate(0.0, 0.0, -1e-9, why)
        m, n, k = found["m"], found["n"], found["k"]
        where = f"{m} x {k} -> {n}"
        timer = getattr(target, "timer", None)
        if timer is not None:
            t32, ttf = time_site(found, timer, self.precision, self.name)
            return Estimate(
                0.0,
                0.0,
                t32 - ttf,
                f"timed at {where}: cuBLAS float32 {t32 * 1e6:.1f} us, opswap::gemm TF32 "
                f"{ttf * 1e6:.1f} us",
            )
        flops = 2.0 * m * n * k
        nbytes = 4.0 * (m * k + n * k + m * n)
        bw = target.mem_bandwidth
        t32 = max(flops / target.peak("float32"), nbytes / bw)
        ttf = max(flops / target.peak("tf32"), nbytes / bw)
        return Estimate(
            0.0,
            0.0,
            t32 - ttf,
            f"roofline at {where}: float32 {target.peak('float32') / 1e12:.0f} TFLOP/s "
            f"against TF32 {target.peak('tf32') / 1e12:.0f} (not timed on the target)",
        )
