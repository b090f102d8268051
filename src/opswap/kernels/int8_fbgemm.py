"""`opswap::int8_linear_fbgemm`: a float32 Linear run as FBGEMM's dynamically quantised
int8 GEMM, the int8 path for x86 CPUs without VNNI or AMX.

Why a second int8 Linear: `opswap::int8_linear` multiplies with `torch._int_mm`, which
runs oneDNN's int8 kernels only where the CPU has VNNI or AMX; on an AVX2-only CPU it
falls back to a scalar loop (788 ms for 128 x 768 -> 3072 on the 2-core AMD EPYC VM,
where float32 takes 38 ms). FBGEMM, PyTorch's x86 quantised backend, has AVX2 int8
kernels (`vpmaddubsw`) and prepacks the weight once: the same layer ran in 25 ms there.

The math (weights as `opswap::int8_linear` holds them):

- weights, once, per output channel n: `w_scale[n] = max_k |W[n, k]| / 127`,
  `Wq = round(W / w_scale)` in int8 (`[K, N]`, the transpose of FBGEMM's layout);
- inputs, on every call, per tensor and asymmetric in 7 bits: `lo = min(min x, 0)`,
  `hi = max(max x, 0)`, `s = (hi - lo) / 127`, `zp = clamp(round(-lo / s), 0, 127)`,
  `xq = clamp(round(x / s) + zp, 0, 127)`;
- `y = ((xq - zp) @ Wq) * s * w_scale + bias`, accumulated in int32 by FBGEMM.

Seven bits and not eight because AVX2's `vpmaddubsw` adds two uint8 x int8 products into
int16 with saturation: 255 * 127 * 2 overflows it, 127 * 127 * 2 does not (what
PyTorch's `reduce_range` is for). One scale for the whole input is coarser than
`opswap::int8_linear`'s per-row scales: about 1.4% relative L2 per layer on random
weights against 0.9% (measured in the tests), which the approx tolerance and the
bisection judge as they do for every lossy site.

The prepacked weight is cached per weight tensor (by identity and version, weakly keyed,
as opswap::conv_relu caches oneDNN's layout), so the op's inputs stay plain tensors that
torch.export saves and reloads. The op needs torch's quantised CPU ops with the FBGEMM
engine (x86 builds of torch 2.11 to 2.13 have them; `available()` says); elsewhere the
op runs `reference`, the same math in float32, and the rule offers no site.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

from opswap.kernels._versions import version

_QMAX_X = 127  # activation levels (7 bits, see the module's docstring)

# weight tensor -> (version, bias identity and version, FBGEMM's packed weight)
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


@functools.cache
def available() -> bool:
    """Whether this torch runs FBGEMM's dynamic int8 Linear on this CPU (asked once: every
    forward of the op asks)."""
    quantized = getattr(torch.ops, "quantized", None)
    try:
        return (
            "fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(quantized, "linear_prepack")
            and hasattr(quantized, "linear_dynamic")
            and hasattr(torch, "_make_per_channel_quantized_tensor")
        )
    except Exception:  # a build without the quantised backends
        return False


@contextlib.contextmanager
def _engine(name: str):
    """torch's quantised engine set to `name` while the weight is packed, and put back:
    the packed object's type, not the global setting, picks the kernel afterwards."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _packed(wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None):
    key = (version(wq), version(w_scale), id(bias), None if bias is None else version(bias))
    hit = _PACKED.get(wq)
    if hit is not None and hit[0] == key:
        return hit[1]
    n = wq.shape[1]
    with torch.no_grad(), warnings.catch_warnings(), _engine("fbgemm"):
        # torch 2.13 warns that quantised tensor creation is deprecated; the packed weight
        # below is the only quantised tensor made, once per weight
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            wq.detach().t().contiguous(),
            w_scale.detach().double(),
            torch.zeros(n, dtype=torch.long),
            0,
        )
        b = None if bias is None else bias.detach().float().contiguous()
        packed = torch.ops.quantized.linear_prepack(qw, b)
    _PACKED[wq] = (key, packed)
    return packed


def reference(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The op's math in float32: what FBGEMM's kernel matches (to float rounding of the
    scale and of the requantised output, relative L2 about 2e-4)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()
    if x2.numel() == 0:
        y = x2 @ wq.float()
    else:
        lo = x2.amin().clamp(max=0.0)
        hi = x2.amax().clamp(min=0.0)
        s = ((hi - lo) / _QMAX_X).clamp_min(1e-12)
        zp = torch.round(-lo / s).clamp(0, _QMAX_X)
        xq = (torch.round(x2 / s) + zp).clamp_(0, _QMAX_X)
        y = ((xq - zp) @ wq.float()) * s * w_scale
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, wq.shape[1]).to(x.dtype)


def direct(x, wq, w_scale, bias) -> torch.Tensor:
    """The kernel: FBGEMM's dynamic int8 Linear on a float32 CPU input, else `reference`."""
    if x.device.type != "cpu" or not available() or x.numel() == 0:
        return reference(x, wq, w_scale, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.quantized.linear_dynamic(x2, _packed(wq, w_scale, bias), True)
    return y.reshape(*lead, wq.shape[1]).to(x.dtype)


@torch.library.custom_op("opswap::int8_linear_fbgemm", mutates_args=())
def int8_linear_fbgemm(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ dequant(wq) + bias with x quantised per tensor to 7-bit uint8 on the fly."""
    return direct(x, wq, w_scale, bias)


@int8_linear_fbgemm.register_fake
def _fake(x, wq, w_scale, bias):
    return x.new_empty((*x.shape[:-1], wq.shape[1]))
