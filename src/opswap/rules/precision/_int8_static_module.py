"""The modules precision.int8_static_linear and precision.int8_static_conv install: int8
weights and a calibrated activation scale, run by opswap.kernels.int8_static's ops.

Each holds its int8 weight and per-channel scales as buffers; the activation's scale and
zero point are plain numbers (they are constants of the traced graph, so torch.export
writes them into model.pt2), kept in the state_dict through `get_extra_state`. The
forward calls the registered op (`torch.ops.opswap.int8_static_*`), one opaque node in
an exported or compiled graph, so the saved file runs onednn's int8 kernel that was
timed; loading it needs opswap's ops registered (`opswap.load_optimized` does that).
For inference only: the rounding has no useful gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.calibrate import Calibration, StoredScales, scale_for
from opswap.graph.observers import QParams
from opswap.kernels import int8_static
from opswap.rules.base import Refused

NO_ONEDNN = (
    "onednn's int8 kernels do not run on this machine (an x86 CPU build of torch with "
    "mkldnn is needed)"
)


def calibrated(
    gm: fx.GraphModule, layer: fx.Node, x: fx.Node
) -> tuple[QParams, Calibration | StoredScales] | Refused:
    """The scale and zero point calibration chose for `x`, the input of `layer` (or the
    scale a re-applied plan holds for it), with where they came from; or why there are
    none (no samples attached, a sample that did not run, no finite value seen)."""
    got = scale_for(gm, layer, x)
    return Refused(got) if isinstance(got, str) else got


class _Static(nn.Module):
    x_scale: float
    x_zp: int
    weight_int8: torch.Tensor
    weight_scale: torch.Tensor
    #: the epilogue's activation ("none", "relu"; a Linear also "gelu", "gelu_tanh")
    post: str = "none"
    #: set by precision.int8_static_handoff: the output requantised to uint8 in the
    #: epilogue with the next layer's input scale (0.0: a float32 output)
    out_scale: float = 0.0
    out_zp: int = 0

    def _set_input(self, qp: QParams) -> None:
        self.x_scale, self.x_zp = float(qp.scale), int(qp.zero_point)

    def _output_repr(self) -> str:
        if self.out_scale <= 0:
            return ""
        return f", output=uint8 scale={self.out_scale:.4g} zero_point={self.out_zp}"

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "x_scale": self.x_scale,
            "x_zp": self.x_zp,
            "post": self.post,
            "out_scale": self.out_scale,
            "out_zp": self.out_zp,
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.x_scale, self.x_zp = float(state["x_scale"]), int(state["x_zp"])
        # a state saved before the handoff existed: the module's own post, float32 output
        self.post = str(state.get("post", self.post))
        self.out_scale = float(state.get("out_scale", 0.0))
        self.out_zp = int(state.get("out_zp", 0))


class Int8StaticLinear(_Static):
    """y = x W^T + b with x quantised by its calibrated scale and W in int8 per channel."""

    opswap_kind = "linear"

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, qp: QParams, per_channel: bool
    ):
        super().__init__()
        wq, scale = int8_static.quantize_weight(weight, per_channel)
        self.out_features, self.in_features = weight.shape
        self.per_channel = per_channel
        self.register_buffer("weight_int8", wq)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._set_input(qp)

    def extra_repr(self) -> str:
        w = "per channel" if self.per_channel else "per tensor"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight=int8 {w}, input=uint8 scale={self.x_scale:.4g} zero_point={self.x_zp}"
            + (f", post={self.post}" if self.post != "none" else "")
            + self._output_repr()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.opswap.int8_static_linear(
            x, self.weight_int8, self.weight_scale, self.x_scale, self.x_zp, self.bias,
            self.post, self.out_scale, self.out_zp,
        )  # fmt: skip


class Int8StaticConv2d(_Static):
    """conv2d (then ReLU when `relu`) with x quantised by its calibrated scale and W in int8."""

    opswap_kind = "conv"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        qp: QParams,
        per_channel: bool,
        stride: tuple[int, ...],
        padding: tuple[int, ...],
        dilation: tuple[int, ...],
        groups: int,
        relu: bool,
    ):
        super().__init__()
        wq, scale = int8_static.quantize_weight(weight, per_channel)
        self.out_channels = weight.shape[0]
        self.per_channel = per_channel
        self.stride, self.padding, self.dilation = list(stride), list(padding), list(dilation)
        self.groups = groups
        self.post = "relu" if relu else "none"
        self.register_buffer("weight_int8", wq)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._set_input(qp)

    @property
    def opswap_weight_shape(self) -> tuple[int, ...]:
        """The weight's shape, for the cost model's FLOP count."""
        return tuple(self.weight_int8.shape)

    def extra_repr(self) -> str:
        w = "per channel" if self.per_channel else "per tensor"
        return (
            f"out_channels={self.out_channels}, kernel={tuple(self.weight_int8.shape[2:])}, "
            f"stride={self.stride}, padding={self.padding}, groups={self.groups}, "
            f"post={self.post}, weight=int8 {w}, input=uint8 scale={self.x_scale:.4g} "
            f"zero_point={self.x_zp}" + self._output_repr()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.opswap.int8_static_conv2d(
            x, self.weight_int8, self.weight_scale, self.x_scale, self.x_zp, self.bias,
            self.stride, self.padding, self.dilation, self.groups, self.post,
            self.out_scale, self.out_zp,
        )  # fmt: skip
