"""The modules the GPU low-bit rules install: a Linear whose weight is stored in INT8,
INT4 (opswap.kernels.weight_only) or FP8 (opswap.kernels.fp8_linear).

Each holds its quantised weight, scales and bias as buffers, so a state_dict round-trips
(and is a fraction of the bfloat16 weight's bytes), and its forward is one registered op,
which torch.export keeps in the saved program and torch.compile keeps as one node. They
are for inference: the rounding has no useful gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from opswap.kernels import fp8_linear as fp8
from opswap.kernels import weight_only as wo


class WeightOnlyLinear(nn.Module):
    """y = x dequant(Wq)^T + b with W in INT8 (per channel by default) or INT4 (groups
    of 128 by default); x stays in its dtype."""

    opswap_kind = "linear"  # the cost model counts a linear's FLOPs (in_features per output)

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bits: int,
        group_size: int | None = None,
    ):
        super().__init__()
        q, scale, offset, g = wo.quantize(weight, bits, group_size)
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = bits, g
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)  # None for INT8: not in the state_dict
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(weight.dtype).clone()
        )

    def extra_repr(self) -> str:
        groups = (
            "per channel" if self.group_size == self.in_features else f"groups of {self.group_size}"
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight=int{self.bits} {groups}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.opswap.wo_linear(
            x, self.qweight, self.scale, self.offset, self.bias, self.bits, self.in_features
        )


class FP8Linear(nn.Module):
    """y = (xq sx)(Wq sw)^T + b with W in float8_e4m3fn (quantised once) and x quantised
    per row (or per tensor) on every call."""

    opswap_kind = "linear"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rowwise: bool = True):
        super().__init__()
        wq, scale = fp8.quantize_weight(weight, rowwise)
        self.out_features, self.in_features = weight.shape
        self.rowwise = rowwise
        self.register_buffer("weight_fp8", wq)
        self.register_buffer("weight_scale", scale)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(weight.dtype).clone()
        )

    def extra_repr(self) -> str:
        how = "row-wise" if self.rowwise else "tensor-wise"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight=float8_e4m3fn {how}, input=e4m3 {how}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.opswap.fp8_linear(
            x, self.weight_fp8, self.weight_scale, self.bias, self.rowwise
        )
