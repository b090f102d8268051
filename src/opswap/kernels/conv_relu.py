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

Every kernel returns its output in the memory format `output_format(x, weight)` names,
with the strides the fake implementation gives (kernels._layout): channels-last where x
or the weight is laid out so over its dims longer than 1, as ATen picks, contiguous
otherwise, including where only a size-1 dim's stride would tell (one input channel),
which ATen reads and the compiler does not keep. Autograd goes through
`aten.convolution_backward` with the gradient masked where the output is zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from opswap.kernels._layout import as_promised, channels_last_of, empty_as_promised, in_format
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


def output_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """The memory format of the op's output, which every kernel and the fake kernel give:
    channels-last (3-D too) when x or the weight is laid out so over its dims longer than 1
    (ATen's convolutions choose so too), contiguous otherwise. A tensor that reads both ways
    (one input channel, a 1x1 image) settles nothing (kernels._layout says why)."""
    if x.dim() != weight.dim():
        return torch.contiguous_format
    return channels_last_of(x) or channels_last_of(weight) or torch.contiguous_format


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
    """relu(conv(x, weight, bias, stride, padding, dilation, groups)); zero padding. The
    output's memory format is `output_format(x, weight)`."""
    return _other(x, weight, bias, stride, padding, dilation, groups)


def _other(x, weight, bias, stride, padding, dilation, groups):
    """The kernel of a device with no fused one: the reference, laid out as promised."""
    fmt = output_format(x, weight)
    y = reference(in_format(x, fmt), weight, bias, stride, padding, dilation, groups)
    return as_promised(y, fmt)


@conv_relu.register_kernel("cpu")
def _cpu(x, weight, bias, stride, padding, dilation, groups):
    fmt = output_format(x, weight)
    x = in_format(x, fmt)
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
    else:
        y = reference(x, weight, bias, stride, padding, dilation, groups)
    return as_promised(y, fmt)


@conv_relu.register_kernel("cuda")
def _cuda(x, weight, bias, stride, padding, dilation, groups):
    fmt = output_format(x, weight)
    x = in_format(x, fmt)
    if (
        _CUDNN_FUSED is not None
        and x.dim() == 4
        and weight.dim() == 4
        and torch.backends.cudnn.enabled
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
    ):
        y = _CUDNN_FUSED(x, weight, bias, list(stride), list(padding), list(dilation), groups)
    else:
        y = reference(x, weight, bias, stride, padding, dilation, groups)
    return as_promised(y, fmt)


def direct(x, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """The op's kernel for x's device, called without the dispatcher (and without
    autograd): what eager inference runs, saving the op's few microseconds of dispatch."""
    kernel = _cuda if x.is_cuda else _cpu if x.device.type == "cpu" else _other
    return kernel(x, weight, bias, stride, padding, dilation, groups)


@conv_relu.register_fake
def _fake(x, weight, bias, stride, padding, dilation, groups):
    y = reference(x, weight, bias, stride, padding, dilation, groups)  # for its size and dtype
    return empty_as_promised(y, output_format(x, weight))


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
