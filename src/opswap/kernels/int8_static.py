"""Statically quantised int8 Linear and Conv2d: activations quantised with a scale and zero
point fixed by calibration, weights per output channel (or per tensor), and the product
computed by onednn's int8 kernels on x86 CPUs; registered as `opswap::int8_static_linear`
and `opswap::int8_static_conv2d`.

The math (x: the float input, s and z: the activation's calibrated scale and zero point):

- `xq = clamp(round(x / s) + z, 0, 255)` in uint8, one pass over the input;
- weights once: `Wq[n] = round(W[n] / w_scale[n])` in int8, with `w_scale[n] = max |W[n]| /
  qmax` per output channel (or one scale for the whole tensor);
- `y = s * w_scale[n] * sum_k (xq[k] - z) * Wq[n, k] + bias[n]`, the sum exact in int32.

Unlike the dynamic scheme (opswap.kernels.int8_linear) there is no pass to find the
input's range at run time, so the kernel is the int8 GEMM or convolution plus one
quantise pass; the price is that inputs beyond the calibrated range are clipped.

Kernels: onednn's `qlinear_pointwise` and `qconv2d_pointwise` (the ones Inductor's x86
int8 lowering calls), with their weights prepacked once per weight tensor and cached.
x86 CPUs without VNNI multiply uint8 by int8 with `vpmaddubsw`, which adds two products
into an int16 and saturates: 255 * 127 * 2 overflows it, and a 768 -> 768 layer measured
a 6.7% error from that alone on an AVX2 machine (zero with 7-bit weights). So weights
are quantised to `weight_qmax()` = 127 on machines with VNNI (or AMX) and 63 on others,
and a layer whose weights use a wider range than this machine's kernel can take (saved
on a VNNI machine, loaded on an older one) runs the reference instead: slower, never
wrong. Elsewhere (no onednn, not x86) the reference runs too: the same integer math in
float32 (exact while the sums stay below 2**24).
"""

from __future__ import annotations

import functools
import platform
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from opswap.kernels._versions import version

_WIDE, _NARROW = 127, 63


@functools.cache
def has_vnni() -> bool:
    """Whether this CPU multiplies uint8 by int8 without int16 saturation (VNNI or AMX)."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    if probe is not None:
        try:
            if probe():
                return True
        except Exception:  # a torch without the probe on this platform
            pass
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(amx and amx())
    except Exception:
        return False


@functools.cache
def onednn_available() -> bool:
    """Whether onednn's int8 ops run here (an x86 CPU build of torch with mkldnn)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
        and hasattr(torch.ops.onednn, "qconv2d_pointwise")
    )


def weight_qmax() -> int:
    """The widest int8 weight range this CPU's kernel takes without saturating."""
    return _WIDE if has_vnni() else _NARROW


def quantize_weight(
    weight: torch.Tensor, per_channel: bool = True, qmax: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight of the same shape, float32 scale per output channel). Per tensor, every
    channel's scale is the same one number."""
    qmax = weight_qmax() if qmax is None else qmax
    w = weight.detach().float()
    flat = w.reshape(w.shape[0], -1).abs()
    amax = flat.amax(dim=1) if per_channel else flat.amax().expand(w.shape[0])
    scale = (amax.clamp_min(1e-12) / qmax).contiguous()
    shape = (-1,) + (1,) * (w.dim() - 1)
    q = torch.round(w / scale.reshape(shape)).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def quantize_activation(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """uint8 `clamp(round(x / scale) + zero_point, 0, 255)`, rounding halves up.

    Three passes rather than five: `zero_point + 0.5 + x / scale` in one `add` (the
    offset as a 0-d tensor, x scaled by `alpha`), the clamp in place, and the cast to
    uint8, which truncates and so rounds the shifted non-negative values. The five-pass
    spelling (mul, round, add, clamp, cast) took about 60% of a static int8 ResNet's time
    on the development CPU, twice what the int8 convolutions took."""
    offset = torch.tensor(zero_point + 0.5, dtype=torch.float32, device=x.device)
    q = torch.add(offset, x.float(), alpha=1.0 / scale).clamp_(0, 255)
    # through int16: ATen's float -> uint8 conversion is not vectorised on the CPU, float
    # -> int16 -> uint8 is, and gives the same bytes for values in [0, 255] (214 us against
    # 53 us for a 256 x 56 x 56 map, torch 2.13 on the development VM)
    return q.to(torch.int16).to(torch.uint8)


def _dequant_input(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    q = x if x.dtype == torch.uint8 else quantize_activation(x, scale, zero_point)
    return (q.float() - zero_point) * scale


def _dequant_weight(wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return wq.float() * w_scale.reshape((-1,) + (1,) * (wq.dim() - 1))


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    """The output's dtype when it is not requantised: the input's, float32 for a uint8 one."""
    return torch.float32 if x.dtype == torch.uint8 else x.dtype


def _post(y: torch.Tensor, post: str) -> torch.Tensor:
    """The activation an epilogue applies (in place on a fresh float32 tensor)."""
    if post == "relu":
        return torch.relu_(y)
    if post in ("gelu", "gelu_tanh"):
        return F.gelu(y, approximate="tanh" if post == "gelu_tanh" else "none")
    return y


def _out(y: torch.Tensor, x: torch.Tensor, out_scale: float, out_zp: int) -> torch.Tensor:
    """The epilogue's output: uint8 by (out_scale, out_zp) when out_scale > 0, else x's
    float dtype."""
    if out_scale > 0:
        return quantize_activation(y, out_scale, out_zp)
    return y.to(_float_dtype(x))


def reference_linear(
    x, wq, w_scale, x_scale: float, x_zp: int, bias, post: str = "none",
    out_scale: float = 0.0, out_zp: int = 0,
) -> torch.Tensor:  # fmt: skip
    """The op's math in float32 (x float, quantised here, or already uint8): what every
    kernel must match."""
    y = F.linear(_dequant_input(x, x_scale, x_zp), _dequant_weight(wq, w_scale), bias)
    return _out(_post(y, post), x, out_scale, out_zp)


def reference_conv2d(
    x, wq, w_scale, x_scale: float, x_zp: int, bias, stride, padding, dilation, groups,
    post: str = "none", out_scale: float = 0.0, out_zp: int = 0,
) -> torch.Tensor:  # fmt: skip
    """The convolution's math in float32 (x either float, quantised here, or already uint8),
    then the ReLU when `post` is "relu", then the output quantised to uint8 by (out_scale,
    out_zp) when out_scale > 0."""
    y = F.conv2d(
        _dequant_input(x, x_scale, x_zp),
        _dequant_weight(wq, w_scale),
        bias,
        stride,
        padding,
        dilation,
        groups,
    )
    return _out(_post(y, post), x, out_scale, out_zp)


# Prepacked weights, one per (weight tensor, packing arguments). The weak reference
# checks that the id still names the same tensor (ids are reused after a tensor dies),
# and the version counter that nothing wrote into it since.
_PACKED: dict[tuple, tuple[weakref.ref, int, Any]] = {}


def _packed(wq: torch.Tensor, key: tuple, pack) -> Any:
    full = (id(wq), *key)
    hit = _PACKED.get(full)
    if hit is not None and hit[0]() is wq and hit[1] == version(wq):
        return hit[2]
    packed = pack()
    if len(_PACKED) > 4096:  # a process that makes many models: forget the dead ones
        for k in [k for k, v in _PACKED.items() if v[0]() is None]:
            del _PACKED[k]
    _PACKED[full] = (weakref.ref(wq), version(wq), packed)
    return packed


def _kernel_ok(x: torch.Tensor, wq: torch.Tensor) -> bool:
    if x.device.type != "cpu" or not onednn_available() or x.numel() == 0 or wq.numel() == 0:
        return False
    # weights wider than this machine's kernel takes (see the module notes) run the reference;
    # whether they fit is found once per weight tensor (no item() per call)
    return _packed(wq, ("fits",), lambda: int(wq.abs().max()) <= weight_qmax())


@functools.lru_cache(maxsize=64)
def _zero_points(n: int) -> torch.Tensor:
    # the weights' zero points (all zero: symmetric), one tensor per channel count, shared
    # by every call (onednn only reads it)
    return torch.zeros(n, dtype=torch.int64)


#: the epilogue activations of onednn's int8 GEMM: (post-op name, algorithm)
_LINEAR_POST = {
    "none": ("none", ""),
    "relu": ("relu", ""),
    "gelu": ("gelu", "none"),
    "gelu_tanh": ("gelu", "tanh"),
}


def _epilogue_out(out_scale: float, out_zp: int) -> tuple[float, int, torch.dtype]:
    return (out_scale, out_zp, torch.uint8) if out_scale > 0 else (1.0, 0, torch.float32)


def direct_linear(
    x, wq, w_scale, x_scale: float, x_zp: int, bias, post: str = "none",
    out_scale: float = 0.0, out_zp: int = 0,
) -> torch.Tensor:  # fmt: skip
    """y = x W^T + b through onednn's int8 GEMM (the reference where it does not run), then
    the activation `post` ("none", "relu", "gelu", "gelu_tanh") in its epilogue; a uint8 x
    is taken as already quantised with (x_scale, x_zp), and out_scale > 0 requantises the
    output to uint8 there (see direct_conv2d)."""
    if not _kernel_ok(x, wq):
        return reference_linear(x, wq, w_scale, x_scale, x_zp, bias, post, out_scale, out_zp)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    xq = x2 if x.dtype == torch.uint8 else quantize_activation(x2, x_scale, x_zp)
    packed = _packed(wq, ("linear",), lambda: torch.ops.onednn.qlinear_prepack(wq, None))
    b = None if bias is None else bias.float()
    name, algorithm = _LINEAR_POST[post]
    y = torch.ops.onednn.qlinear_pointwise(
        xq.contiguous(), x_scale, x_zp, packed, w_scale, _zero_points(wq.shape[0]), b,
        *_epilogue_out(out_scale, out_zp), name, [], algorithm,
    )  # fmt: skip
    y = y.reshape(*lead, wq.shape[0])
    return y if out_scale > 0 else y.to(_float_dtype(x))


_CONV_POST = {"none": "none", "relu": "relu"}


def direct_conv2d(
    x, wq, w_scale, x_scale: float, x_zp: int, bias, stride, padding, dilation, groups,
    post: str = "none", out_scale: float = 0.0, out_zp: int = 0,
) -> torch.Tensor:  # fmt: skip
    """conv2d(x, W, b) (then ReLU when `post` is "relu") through onednn's int8 convolution;
    the output is channels-last, as onednn writes it.

    A uint8 `x` is taken as already quantised with (x_scale, x_zp): the output of a
    convolution before it that requantised in its epilogue. With `out_scale` > 0 the output
    is requantised the same way, in the epilogue, to uint8 with (out_scale, out_zp): the
    next convolution's input scale, so that the float32 map between the two is never
    written and the next one skips its quantise pass."""
    if not _kernel_ok(x, wq) or x.dim() != 4:
        y = reference_conv2d(
            x, wq, w_scale, x_scale, x_zp, bias, stride, padding, dilation, groups,
            post, out_scale, out_zp,
        )  # fmt: skip
        return y.contiguous(memory_format=torch.channels_last)
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    xq = x if x.dtype == torch.uint8 else quantize_activation(x, x_scale, x_zp)
    xq = xq.contiguous(memory_format=torch.channels_last)
    # packed for this input shape: onednn picks the convolution's weight blocking from the
    # whole problem, and a weight packed without the shape (a guessed one) was reordered
    # again on every call by onednn's slow generic reorder (ResNet-50 on a VNNI CPU: 59 ms
    # of reorders against 10 ms of convolutions a run). A model that meets several shapes
    # keeps one packing per shape.
    args = (tuple(stride), tuple(padding), tuple(dilation), groups, x_scale, x_zp)
    packed = _packed(
        wq,
        ("conv2d", *args, tuple(xq.shape)),
        lambda: torch.ops.onednn.qconv_prepack(
            wq, w_scale, x_scale, x_zp, stride, padding, dilation, groups, list(xq.shape)
        ),
    )
    b = None if bias is None else bias.float()
    y = torch.ops.onednn.qconv2d_pointwise(
        xq, x_scale, x_zp, packed, w_scale, _zero_points(wq.shape[0]), b,
        stride, padding, dilation, groups, *_epilogue_out(out_scale, out_zp),
        _CONV_POST[post], [], "",
    )  # fmt: skip
    if out_scale <= 0:
        y = y.to(_float_dtype(x))
    return y.contiguous(memory_format=torch.channels_last)


@torch.library.custom_op("opswap::int8_static_linear", mutates_args=())
def int8_static_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: float,
    x_zp: int,
    bias: torch.Tensor | None,
    post: str = "none",
    out_scale: float = 0.0,
    out_zp: int = 0,
) -> torch.Tensor:
    """x W^T + b with x quantised by the calibrated (x_scale, x_zp) (or given in uint8,
    already quantised so) and W in int8 [N, K]; `post` ("none", "relu", "gelu",
    "gelu_tanh") in the epilogue; with out_scale > 0 the output is uint8, quantised by
    (out_scale, out_zp) there."""
    return direct_linear(x, wq, w_scale, x_scale, x_zp, bias, post, out_scale, out_zp)


@int8_static_linear.register_fake
def _fake_linear(x, wq, w_scale, x_scale, x_zp, bias, post="none", out_scale=0.0, out_zp=0):
    dtype = torch.uint8 if out_scale > 0 else _float_dtype(x)
    return x.new_empty((*x.shape[:-1], wq.shape[0]), dtype=dtype)


@torch.library.custom_op("opswap::int8_static_conv2d", mutates_args=())
def int8_static_conv2d(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: float,
    x_zp: int,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    post: str,
    out_scale: float = 0.0,
    out_zp: int = 0,
) -> torch.Tensor:
    """conv2d with x quantised by the calibrated (x_scale, x_zp) (or given in uint8, already
    quantised so) and W in int8; `post` is "none" or "relu" (fused into the convolution's
    epilogue); with out_scale > 0 the output is uint8, quantised by (out_scale, out_zp) in
    the epilogue. The output is channels-last."""
    return direct_conv2d(
        x, wq, w_scale, x_scale, x_zp, bias, stride, padding, dilation, groups, post,
        out_scale, out_zp,
    )  # fmt: skip


@int8_static_conv2d.register_fake
def _fake_conv(
    x, wq, w_scale, x_scale, x_zp, bias, stride, padding, dilation, groups, post,
    out_scale=0.0, out_zp=0,
):  # fmt: skip
    n, _, h, w = x.shape
    kh, kw = wq.shape[2], wq.shape[3]
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    dtype = torch.uint8 if out_scale > 0 else _float_dtype(x)
    y = x.new_empty((n, wq.shape[0], oh, ow), dtype=dtype)
    return y.contiguous(memory_format=torch.channels_last)


def describe() -> dict[str, Any]:
    """What this machine's int8 kernels are, for reports."""
    return {
        "onednn": onednn_available(),
        "vnni": has_vnni(),
        "weight_qmax": weight_qmax(),
    }
