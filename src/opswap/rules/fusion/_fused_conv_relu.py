"""Modules that fusion rewrites install: a convolution with ReLU fused into its epilogue.

Unfused, Conv -> ReLU writes the conv output to memory and reads it back for
the ReLU: 2 x N*C*H*W*4 bytes of traffic for nothing but a max(0, x). oneDNN
(CPU) and cuDNN (GPU) can apply the ReLU to each output tile while it is still
in registers, so that intermediate never exists.

The module keeps weight and bias as ordinary parameters (a plain state_dict),
and runs the fused kernel only where one exists and pays: float32 on CPU
through `mkldnn._convolution_pointwise`, with the weight reordered once into
oneDNN's blocked layout and cached, or float32 `cudnn_convolution_relu` on
CUDA. Any other case (other dtypes, gradients needed, tracing or export) runs
the plain conv followed by an in-place ReLU, which computes the same numbers.

Measured (torch 2.11, one H200 host, ResNet-like 3x3/1x1/7x7 layers, batch 1-8):
on 2 CPU threads the prepacked fused op ran 0.85-1.01x the time of a folded conv +
relu_ (within 1.5% on the one shape where it was not faster), on 16 threads
0.68-0.98x; passing the plain weight instead (oneDNN reorders it on every call)
was up to 3.5x slower, hence the cache.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

_MKLDNN_OPS = getattr(torch.ops, "mkldnn", None)
_MKLDNN_FUSED = getattr(_MKLDNN_OPS, "_convolution_pointwise", None) if _MKLDNN_OPS else None
_MKLDNN_REORDER = getattr(_MKLDNN_OPS, "_reorder_convolution_weight", None) if _MKLDNN_OPS else None
_CUDNN_FUSED = getattr(torch, "cudnn_convolution_relu", None)
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def mkldnn_fused_available() -> bool:
    """True when this torch build has oneDNN's fused conv + pointwise op."""
    return _MKLDNN_FUSED is not None and torch.backends.mkldnn.is_available()


def _capturing(x) -> bool:
    """True while a tracer or exporter runs the module: it should see plain ops."""
    if isinstance(x, fx.Proxy):
        return True
    return bool(torch.compiler.is_compiling() or torch.compiler.is_exporting()
                or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export())


class FusedConvReLU(nn.Module):
    """relu(conv(x, weight, bias)) as one kernel where the device has one.

    Zero padding only (`padding` is explicit per spatial dim); weight layout as
    nn.ConvNd's, [out, in / groups, *kernel].
    """

    opswap_kind = "conv"  # what graph.ops.op_kind reports: the cost model counts a conv
    fused_activation = "relu"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding,
                 dilation, groups: int, requires_grad: bool = True):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        self.stride = tuple(int(s) for s in stride)
        self.padding = tuple(int(p) for p in padding)
        self.dilation = tuple(int(d) for d in dilation)
        self.groups = int(groups)
        self._packed: tuple[tuple, torch.Tensor] | None = None  # (key, oneDNN weight); not state

    def extra_repr(self) -> str:
        out, inp, *k = self.weight.shape
        return (f"{inp * self.groups}, {out}, kernel_size={tuple(k)}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}")

    def __getstate__(self):
        # the oneDNN weight is an opaque tensor: it neither copies nor pickles; rebuild it
        state = self.__dict__.copy()
        state["_packed"] = None
        return state

    def _needs_grad(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (
            x.requires_grad or self.weight.requires_grad
            or (self.bias is not None and self.bias.requires_grad))

    def _spatial(self, x: torch.Tensor) -> bool:
        return x.dim() == self.weight.dim()  # batched input; unbatched takes the plain path

    def _onednn_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The weight reordered into oneDNN's blocked layout, computed once per weight."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed[0] != key:
            packed = self.weight
            if _MKLDNN_REORDER is not None and self.weight.dim() == 4:
                with torch.no_grad():
                    packed = _MKLDNN_REORDER(self.weight.detach(), list(self.padding),
                                             list(self.stride), list(self.dilation),
                                             self.groups, list(x.shape))
            self._packed = (key, packed)
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _capturing(x) and self._spatial(x) and not self._needs_grad(x):
            if (x.device.type == "cpu" and x.dtype == torch.float32
                    and self.weight.dtype == torch.float32 and mkldnn_fused_available()):
                return _MKLDNN_FUSED(x, self._onednn_weight(x), self.bias, list(self.padding),
                                     list(self.stride), list(self.dilation), self.groups,
                                     "relu", [], "")
            # float32 only: on an H200, cuDNN's fused kernel lost to conv + relu_ by up to
            # 30% on some float16 shapes, and tied or won on every float32 one measured
            if (x.is_cuda and _CUDNN_FUSED is not None and x.dim() == 4
                    and torch.backends.cudnn.enabled and x.dtype == torch.float32
                    and self.weight.dtype == torch.float32):
                return _CUDNN_FUSED(x, self.weight, self.bias, list(self.stride),
                                    list(self.padding), list(self.dilation), self.groups)
        conv = _CONV[self.weight.dim() - 2]
        y = conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return F.relu(y, inplace=True)
