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
"""

from __future__ import annotations

import torch
from torch import nn

from opswap.kernels.int8_linear import direct, quantize_weight


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (per output channel) and x quantised per row on the fly."""

    opswap_kind = "linear"  # the cost model counts a linear's FLOPs (in_features per output)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
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
            f"bias={self.bias is not None}, weight=int8 per channel, input=int8 per row"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return direct(x, self.weight_int8, self.weight_scale, self.bias)
