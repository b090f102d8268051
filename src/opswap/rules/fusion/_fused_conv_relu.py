"""Modules that fusion rewrites install: a convolution with ReLU fused into its epilogue.

Unfused, Conv -> ReLU writes the conv output to memory and reads it back for
the ReLU: 2 x N*C*H*W*4 bytes of traffic for nothing but a max(0, x). oneDNN
(CPU) and cuDNN (GPU) can apply the ReLU to each output tile while it is still
in registers, so that intermediate never exists.

The module keeps weight and bias as ordinary parameters (a plain state_dict)
and calls the registered op `opswap::conv_relu` (opswap.kernels.conv_relu),
which picks the fused kernel where one exists and pays and the plain conv +
ReLU elsewhere. Being an op, it survives torch.export and torch.compile, so the
saved model.pt2 runs the kernel that was measured. TorchScript tracing and the
TorchScript ONNX exporter see the plain ops.

Measured (torch 2.11, one H200 host, ResNet-like 3x3/1x1/7x7 layers, batch 1-8):
on 2 CPU threads the prepacked fused op ran 0.85-1.01x the time of a folded conv +
relu_ (within 1.5% on the one shape where it was not faster), on 16 threads
0.68-0.98x; passing the plain weight instead (oneDNN reorders it on every call)
was up to 3.5x slower, hence the op's cache of reordered weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
from torch import nn

from opswap.kernels.conv_relu import conv_relu, direct, mkldnn_fused_available, reference

__all__ = ["FusedConvReLU", "mkldnn_fused_available"]


def _tracing(x: object) -> bool:
    """True while FX, Dynamo or torch.export trace the module, or AOTAutograd does for
    Inductor (on fake tensors, where the oneDNN kernel cannot run): they must see the op."""
    from torch._subclasses.fake_tensor import is_fake

    return bool(
        isinstance(x, fx.Proxy)
        or torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or is_fake(x)
    )


def _scripting() -> bool:
    """True under TorchScript tracing or the TorchScript ONNX exporter, which cannot
    keep a custom op: they get the plain ops."""
    return bool(torch.jit.is_tracing() or torch.onnx.is_in_onnx_export())


class FusedConvReLU(nn.Module):
    """relu(conv(x, weight, bias)) as one kernel where the device has one.

    Zero padding only (`padding` is explicit per spatial dim); weight layout as
    nn.ConvNd's, [out, in / groups, *kernel].
    """

    opswap_kind = "conv"  # what graph.ops.op_kind reports: the cost model counts a conv
    fused_activation = "relu"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: Sequence[int],
        padding: Sequence[int],
        dilation: Sequence[int],
        groups: int,
        requires_grad: bool = True,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        self.stride = tuple(int(s) for s in stride)
        self.padding = tuple(int(p) for p in padding)
        self.dilation = tuple(int(d) for d in dilation)
        self.groups = int(groups)

    def extra_repr(self) -> str:
        out, inp, *k = self.weight.shape
        return (
            f"{inp * self.groups}, {out}, kernel_size={tuple(k)}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
            f"bias={self.bias is not None}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _scripting():
            return reference(
                x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
            )
        args = (x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        if _tracing(x) or self._needs_grad(x):
            return conv_relu(*args)  # the registered op, with its autograd formula
        return direct(*args)  # eager inference: the same kernel, without the dispatch

    def _needs_grad(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (
            x.requires_grad
            or self.weight.requires_grad
            or (self.bias is not None and self.bias.requires_grad)
        )
