"""`opswap::conv_relu`: relu(conv(x, weight, bias)) as one registered op.

Why an op and not only a module: torch.export (and so the saved `model.pt2`) and
torch.compile trace through Python modules and keep only registered ops. A
module that picks oneDNN's fused kernel in its forward is exported as plain
`aten.convolution` + `aten.relu_`, so the saved model loses the speed that was
measured. Registered through `torch.library.custom_op`, the fused conv stays one
node in the exported graph and in Inductor's; loading the program needs only
`import opswap` (which registers the op) before `torch.export.load`.

Kernels, by device:

- CPU, float32, batched input, oneDNN present: `mkldnn._convolution_pointwise`
  with the ReLU as a post-op, the weight reordered once into oneDNN's blocked
  layout and cached per weight tensor (by identity and version, so an in-place
  weight update is seen);
- CUDA, float32, 2-D: `torch.cudnn_convolution_relu` (cuDNN's fused epilogue;
  on an H200 it lost to conv + relu_ by up to 30% on some float16 shapes, and
  tied or won on every float32 one measured, hence float32 only);
- anything else: the reference, conv followed by an in-place ReLU.

The fake implementation is the reference run on fake tensors, so shapes and
strides agree with eager. Autograd goes through `aten.convolution_backward` with
the gradient masked where the output is zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from opswap.kernels._versions import version

_MKLDNN = getattr(torch.ops, "mkldnn", None)
_MKLDNN_FUSED = getattr(_MKLDNN, "_convolution_pointwise", None) if _MKLDNN else None
_MKLDNN_REORDER = getattr(_MKLDNN, "_reorder_convolution_weight", None) if _MKLDNN else None
_CUDNN_FUSED = getattr(torch, "cudnn_convolution_relu", None)
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

# weight tensor -> (key, oneDNN-layout weight). Weakly keyed: a freed weight drops its entry.
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mkldnn_fused_available() -> bool:
    """True when this torch build has oneDNN's fused conv + pointwise op."""
    return _MKLDNN_FUSED is not None and torch.backends.mkldnn.is_available()


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """The plain computation every kernel must match: conv, then ReLU."""
    conv = _CONV[weight.dim() - 2]
    y = conv(x, weight, bias, list(stride), list(padding), list(dilation), groups)
    return F.relu(y, inplace=True)


def _onednn_weight(x, weight, stride, padding, dilation, groups) -> torch.Tensor:
    key = (version(weight), tuple(stride), tuple(padding), tuple(dilation), groups)
    hit = _PACKED.get(weight)
    if hit is not None and hit[0] == key:
        return hit[1]
    packed = weight
    if _MKLDNN_REORDER is not None and weight.dim() == 4:
        with torch.no_grad():
            packed = _MKLDNN_REORDER(
                weight.detach(), list(padding), list(stride), list(dilation), groups, list(x.shape)
            )
    _PACKED[weight] = (key, packed)
    return packed


def _strides(shape: Sequence[int], channels_last: bool) -> list[int]:
    order = (
        [1, *range(len(shape) - 1, 1, -1), 0]
        if channels_last
        else list(range(len(shape) - 1, -1, -1))
    )  # innermost first
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d] = step
        step *= max(int(shape[d]), 1)
    return strides


def _like_reference(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The output in the memory format and strides the reference conv gives (what the fake
    op promises to the compiler), copying only when the layout really differs."""
    channels_last = (
        x.dim() == 4
        and x.is_contiguous(memory_format=torch.channels_last)
        and not x.is_contiguous()
    )
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    y = y.contiguous(memory_format=fmt)
    want = _strides(y.shape, channels_last)
    # strides of size-1 dims address nothing: restating them is free
    return y if list(y.stride()) == want else y.as_strided(y.shape, want)


@torch.library.custom_op("opswap::conv_relu", mutates_args=())
def conv_relu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """relu(conv(x, weight, bias, stride, padding, dilation, groups)); zero padding."""
    return reference(x, weight, bias, stride, padding, dilation, groups)


@conv_relu.register_kernel("cpu")
def _cpu(x, weight, bias, stride, padding, dilation, groups):
    if (
        x.dim() == weight.dim()
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and mkldnn_fused_available()
    ):
        w = _onednn_weight(x, weight, stride, padding, dilation, groups)
        y = _MKLDNN_FUSED(
            x, w, bias, list(padding), list(stride), list(dilation), groups, "relu", [], ""
        )
        return _like_reference(y, x)
    return reference(x, weight, bias, stride, padding, dilation, groups)


@conv_relu.register_kernel("cuda")
def _cuda(x, weight, bias, stride, padding, dilation, groups):
    if (
        _CUDNN_FUSED is not None
        and x.dim() == 4
        and weight.dim() == 4
        and torch.backends.cudnn.enabled
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
    ):
        return _like_reference(
            _CUDNN_FUSED(x, weight, bias, list(stride), list(padding), list(dilation), groups), x
        )
    return reference(x, weight, bias, stride, padding, dilation, groups)


def direct(x, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """The op's kernel for x's device, called without the dispatcher (and without
    autograd): what eager inference runs, saving the op's few microseconds of dispatch."""
    kernel = _cuda if x.is_cuda else _cpu if x.device.type == "cpu" else reference
    return kernel(x, weight, bias, stride, padding, dilation, groups)


@conv_relu.register_fake
def _fake(x, weight, bias, stride, padding, dilation, groups):
    return reference(x, weight, bias, stride, padding, dilation, groups)


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(x, weight, output)
    ctx.has_bias = bias is not None
    ctx.conv = (list(stride), list(padding), list(dilation), groups)


def _backward(ctx, grad):
    x, weight, out = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    g = grad * (out > 0).to(grad.dtype)
    mask = [
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
        ctx.has_bias and ctx.needs_input_grad[2],
    ]
    gx, gw, gb = torch.ops.aten.convolution_backward(
        g,
        x,
        weight,
        [weight.shape[0]] if ctx.has_bias else None,
        stride,
        padding,
        dilation,
        False,
        [0] * (weight.dim() - 2),
        groups,
        mask,
    )
    return gx, gw, gb if ctx.has_bias else None, None, None, None, None


conv_relu.register_autograd(_backward, setup_context=_setup_context)
