"""`opswap::conv_onednn`: a conv2d by oneDNN with its weight packed once, channels-last.

PyTorch's eager conv on the CPU calls oneDNN too, but every call hands it the weight in
PyTorch's layout ([O, C, kh, kw], or [O, kh, kw, C] in channels-last), and oneDNN first
reorders it into the blocked layout its brgemm kernels read (`Acdb32a`: 32 output
channels interleaved). For a 512 -> 512 3x3 layer that reorder is 9.4 MB read and written
a call, on a layer whose batch-1 convolution reads 0.1-0.4 MB of activations: at ResNet's
512@7 it is more than half of PyTorch's time. Inductor's CPU path (`torch.compile` with
freezing) packs the weight once, ahead of time (`mkldnn._reorder_convolution_weight`), and
calls `mkldnn._convolution_pointwise` on channels-last activations; this op does the same
in eager mode:

    packed = _reorder_convolution_weight(weight, padding, stride, dilation, groups, x.shape)
    y = _convolution_pointwise(x_cl, packed, bias, padding, stride, dilation, groups, "none")

The packed weight is cached per weight tensor (by its identity and version, so an in-place
update is seen, and by the settings and input shape oneDNN chose the layout for; a few
shapes per weight). The multiplications are the direct convolution's: the op is exact
(the same products, summed in oneDNN's order).

The edges. oneDNN's brgemm kernels read and write NHWC. An input in channels-last is used
as it is and the output stays channels-last: a model already in channels-last pays
nothing. An NCHW input is handed to oneDNN as it is (it converts inside its primitive,
which measured up to 10% faster than a PyTorch copy to channels-last first, at ResNet's
64@56), and the channels-last output it gives back is copied to NCHW. Either way the
conversions are inside the op, so a race timing the op on the graph's tensors counts them:
on a 2-core EPYC an NCHW call of a batch-1 ResNet/VGG 3x3 layer took 9-26% longer than a
channels-last one (73% at VGG's 64@224), mostly that output copy.

Refused: a build without oneDNN (mkldnn) or without the two ops (they exist from torch
2.1), conv1d and 3-D convs, dtypes other than float32, and tensors not on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from opswap.kernels._layout import as_promised, channels_last_of, empty_as_promised
from opswap.kernels._versions import version
from opswap.kernels.conv_algorithms import (
    ConvAlgorithm,
    ConvSite,
    check_cpu_float32_conv2d,
    cpu_float32_conv2d_refusal,
    register,
)
from opswap.kernels.conv_im2col import output_sizes

#: packed layouts kept per weight (one per input shape and settings oneDNN packed for)
MAX_PACKED = 4
# weight tensor -> {(version, settings, input shape): packed weight}; weakly keyed
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def available() -> str | None:
    """Why this torch build cannot run the op, or None."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    mkldnn = torch.ops.mkldnn
    for name in ("_reorder_convolution_weight", "_convolution_pointwise"):
        if not hasattr(mkldnn, name):
            return f"this PyTorch build has no torch.ops.mkldnn.{name}"
    return None


def _packed(
    weight: torch.Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    shape: list[int],
) -> torch.Tensor:
    """The weight in oneDNN's blocked layout for this input shape, packed once (again after
    an in-place write to the weight). A tensor subclass is packed every call, uncached."""
    reorder = torch.ops.mkldnn._reorder_convolution_weight
    settings = (padding, stride, dilation, groups)
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return reorder(weight.detach(), *settings, shape)  # type: ignore[no-any-return]
    key = (version(weight), tuple(stride), tuple(padding), tuple(dilation), groups, tuple(shape))
    table = _PACKED.get(weight)
    if table is None:
        table = _PACKED[weight] = {}
    hit = table.get(key)
    if hit is None:
        if len(table) >= MAX_PACKED:
            table.pop(next(iter(table)))
        with torch.no_grad():
            hit = table[key] = reorder(weight.detach().contiguous(), *settings, shape)
    return hit  # type: ignore[no-any-return]


@torch.library.custom_op("opswap::conv_onednn", mutates_args=())
def conv_onednn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """conv2d(x, weight, bias, stride, padding, dilation, groups) by oneDNN on a prepacked
    weight; float32 on the CPU, zero padding; the output is channels-last for a
    channels-last input, NCHW otherwise."""
    check_cpu_float32_conv2d("conv_onednn", x, weight, groups)
    why = available()
    if why is not None:
        raise ValueError(f"conv_onednn cannot run: {why}")
    s, p, d = [int(v) for v in stride], [int(v) for v in padding], [int(v) for v in dilation]
    fmt = channels_last_of(x) or torch.contiguous_format
    if x.shape[0] == 0 or min(output_sizes(x, weight, s, p, d)) <= 0:
        # nothing for oneDNN to compute (or a size PyTorch refuses in its own words)
        return as_promised(F.conv2d(x, weight, bias, s, p, d, groups), fmt)
    # NCHW goes in as it is (oneDNN converts inside its primitive, faster than a copy
    # first); channels-last goes in with no copy. The output comes back channels-last.
    x_in = x.contiguous(memory_format=fmt)
    packed = _packed(weight, s, p, d, groups, list(x.shape))
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    y = torch.ops.mkldnn._convolution_pointwise(x_in, packed, b, p, s, d, groups, "none", [], "")
    return as_promised(y, fmt)


@conv_onednn.register_fake
def _fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    check_cpu_float32_conv2d("conv_onednn", x, weight, groups)
    y = x.new_empty(
        (x.shape[0], weight.shape[0], *output_sizes(x, weight, stride, padding, dilation))
    )
    return empty_as_promised(y, channels_last_of(x) or torch.contiguous_format)


def _refuses(site: ConvSite) -> str | None:
    why = available()
    if why is not None:
        return why
    return cpu_float32_conv2d_refusal(site, "the prepacked oneDNN conv")


ALGORITHM = register(
    ConvAlgorithm(
        name="onednn_prepacked",
        op=torch.ops.opswap.conv_onednn.default,
        exactness="exact",
        refuses=_refuses,
        extra=ConvSite.settings,
        multiplications=lambda site: site.direct_multiplications(),
        description="oneDNN's direct conv on a weight packed once into its blocked layout, "
        "activations in channels-last (what Inductor's CPU path runs)",
    )
)
