"""The module precision.int8_linear installs: a Linear whose weight is stored in int8.

It holds the quantised weight `[K, N]` and its per-output-channel scales as buffers (a
plain state_dict, a quarter of the float32 weight's bytes). Its forward is the kernel of
opswap.kernels.int8_linear written in ATen ops (row quantise, `aten._int_mm`, rescale),
in eager inference and when traced alike: torch.export keeps those ops (so model.pt2
runs the integer GEMM that was timed, and loads without opswap), and torch.compile sees
the quantise and rescale steps and fuses them. Measured (2-core CPU, torch 2.13, three
768 -> 3072 -> 768 MLP blocks at 64 rows, one run): reloaded model.pt2 1.99x float32
both ways; compiled, 2.09x when the forward was the opaque op `opswap::int8_linear` and
2.52x as ATen ops, against 2.25x for torchao's int8 dynamic quantisation compiled. It is
for inference: the rounding has no useful gradient, and training through it is not
supported.

On an x86 CPU without VNNI or AMX, where `torch._int_mm` has no int8 kernel, the module
runs `kernel="fbgemm"`: the same int8 weights multiplied by FBGEMM's AVX2 kernel with the
input quantised per tensor in 7 bits (opswap.kernels.int8_fbgemm, one opaque op, as
FBGEMM's prepacked weight is not a tensor that export could hold).
"""

from __future__ import annotations

import torch
from torch import nn

from opswap.kernels.int8_fbgemm import int8_linear_fbgemm
from opswap.kernels.int8_linear import direct, quantize_weight

#: the int8 GEMMs the module can run: torch._int_mm (oneDNN on VNNI/AMX CPUs, cuBLASLt on
#: CUDA) with per-row input scales, or FBGEMM (AVX2) with one 7-bit scale per input
KERNELS = ("int_mm", "fbgemm")


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (per output channel) and x quantised per row on the fly."""

    opswap_kind = "linear"  # the cost model counts a linear's FLOPs (in_features per output)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str = "int_mm"):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"Int8Linear's kernel is one of {', '.join(KERNELS)}; got {kernel!r}.")
        self.kernel = kernel
        wq, scale = quantize_weight(weight)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_int8", wq)
        self.register_buffer("weight_scale", scale)
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight=int8 per channel, "
            + ("input=int8 per row" if self.kernel == "int_mm" else "input=7-bit per tensor")
            + f", kernel={self.kernel}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "fbgemm":
            return int8_linear_fbgemm(x, self.weight_int8, self.weight_scale, self.bias)
        return direct(x, self.weight_int8, self.weight_scale, self.bias)
