"""FP8 (e4m3) Linear through `torch._scaled_mm`, registered as the op `opswap::fp8_linear`.

The math: `y = (xq * sx) @ (Wq * sw)^T + b`, with

- weights quantised once: row-wise `sw[n] = max_k |W[n, k]| / 448` (per output channel)
  or tensor-wise `sw = max |W| / 448`, `Wq = W / sw` rounded to float8_e4m3fn;
- activations quantised on every call (dynamic scaling): row-wise `sx[m] = max_k |x[m, k]|
  / 448` (per token) or tensor-wise over the whole input;
- the product on the FP8 tensor cores with fp32 accumulation, scaled and written in
  bfloat16 (row-wise scaling needs a Hopper GPU; tensor-wise runs from compute capability
  8.9).

448 is e4m3's largest finite value; e4m3 keeps 3 mantissa bits, so each element errs by
up to 2^-4 of its value and a layer's output by about 3% (relative L2) on random data.

Why it is faster: on an H200 FP8 doubles the dense tensor-core rate (1979 against 989
TFLOP/s on the datasheet) and halves the weight's bytes. It pays where the GEMM is
compute-bound (prefill: thousands of rows); on a few rows the GEMM is memory-bound and
the activation quantisation, one more kernel per Linear, costs more than the halved
weight saves, which is why the rule refuses small GEMMs.

Kernels: on CUDA the per-row quantisation of x is `_quant_rows_kernel` (Triton: one pass
that reads a row once, takes its max and writes the e4m3 row and its scale, against the
four passes abs / amax / divide / cast of the same in ATen ops), then `_scaled_mm`. On
anything else the op runs `simulate`: the same quantisation and a float32 product, so
the op runs everywhere (it is not faster there). `reference` is the function in float64.
"""

from __future__ import annotations

from typing import Any

import torch

from opswap.kernels.weight_only import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
#: the largest K the one-pass row quantisation holds in registers; above it, ATen ops
MAX_ROW = 16384


def fp8_supported(device: torch.device | str, rowwise: bool = True) -> str | None:
    """None when FP8 `_scaled_mm` runs on `device` with this scaling, else why not."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"FP8 GEMMs need a CUDA GPU, and this device is {dev.type}"
    if not torch.cuda.is_available():
        return "FP8 GEMMs need a CUDA GPU, and torch sees none"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        return (
            f"{torch.cuda.get_device_name(dev)} has compute capability {cap[0]}.{cap[1]}, "
            "and FP8 tensor cores start at 8.9 (Ada, Hopper)"
        )
    if rowwise and cap < (9, 0):
        return (
            f"row-wise FP8 scaling needs compute capability 9.0 (Hopper), and "
            f"{torch.cuda.get_device_name(dev)} has {cap[0]}.{cap[1]}; use tensor-wise scales"
        )
    return None


def shape_supported(in_features: int, out_features: int) -> str | None:
    """None when `_scaled_mm` takes a K -> N layer, else why not."""
    if in_features % 16 or out_features % 16:
        return (
            f"{in_features} -> {out_features} features: FP8 GEMMs need both to be multiples of 16"
        )
    return None


def quantize_weight(
    weight: torch.Tensor, rowwise: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wq [N, K] float8_e4m3fn, sw [N] float32 row-wise or [] tensor-wise)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if rowwise else w.abs().amax()
    scale = amax.clamp_min(1e-12) / FP8_MAX
    wq = (w / (scale[:, None] if rowwise else scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return wq.contiguous(), scale


def _quant_rows_torch(x2: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x2.float()
    amax = xf.abs().amax(dim=1, keepdim=True) if rowwise else xf.abs().amax().reshape(1, 1)
    scale = amax.clamp_min(1e-12) / FP8_MAX
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def _quant_rows_fn(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK: tl.constexpr):
    # one row per program: read 2K bytes, write K + 4; the ATen spelling moves ~7K
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    ok = k < K
    x = tl.load(x_ptr + row * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + row * K + k, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


_QUANT: dict[bool, Any] = {}


def quantize_rows(x2: torch.Tensor, rowwise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] float8_e4m3fn, sx [M, 1] row-wise or [1, 1] tensor-wise, float32)."""
    m, k = x2.shape
    usable = x2.is_cuda or (x2.device.type == "cpu" and interpreting())
    if not rowwise or triton is None or not usable or k > MAX_ROW or m == 0:
        return _quant_rows_torch(x2, rowwise)
    key = interpreting()
    if key not in _QUANT:
        _QUANT[key] = triton.jit(_quant_rows_fn)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty((m, k), device=x2.device, dtype=FP8)
    s = torch.empty((m, 1), device=x2.device, dtype=torch.float32)
    block = triton.next_power_of_2(k)
    _QUANT[key][(m,)](x2, q, s, k, x2.stride(0), BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return q, s


def simulate(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    rowwise: bool,
) -> torch.Tensor:
    """The op's function with the FP8 product done in float32 (where `_scaled_mm` is not)."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, sx = _quant_rows_torch(x.reshape(-1, k), rowwise)
    sw = w_scale[None, :] if rowwise else w_scale
    y = (xq.float() @ wq.float().t()) * sx * sw
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*lead, wq.shape[0]).to(x.dtype)


def reference(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    rowwise: bool,
) -> torch.Tensor:
    """The op's function in float64: x quantised as the op does, both operands' e4m3
    values times their scales, the product and the bias in float64."""
    k = x.shape[-1]
    xq, sx = _quant_rows_torch(x.reshape(-1, k), rowwise)
    sw = w_scale.double()[:, None] if rowwise else w_scale.double()
    y = (xq.double() * sx.double()) @ (wq.double() * sw).t()
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], wq.shape[0])


def scaled_mm(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    rowwise: bool,
) -> torch.Tensor:
    """x quantised per row (or per tensor), then `torch._scaled_mm` into bfloat16."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, sx = quantize_rows(x.reshape(-1, k), rowwise)
    sw = w_scale.reshape(1, -1) if rowwise else w_scale.reshape(())
    y = torch._scaled_mm(
        xq,
        wq.t(),  # [K, N], column-major as the FP8 GEMM wants it
        scale_a=sx if rowwise else sx.reshape(()),
        scale_b=sw,
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )
    return y.reshape(*lead, wq.shape[0]).to(x.dtype)


@torch.library.custom_op("opswap::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    rowwise: bool,
) -> torch.Tensor:
    """x [..., K] @ (Wq * sw)^T + bias with x quantised to e4m3 on the fly, in x's dtype."""
    return simulate(x, wq, w_scale, bias, rowwise)


@fp8_linear.register_kernel("cuda")
def _cuda(x, wq, w_scale, bias, rowwise):
    n, k = wq.shape
    if fp8_supported(x.device, rowwise) is None and shape_supported(k, n) is None and x.numel() > 0:
        return scaled_mm(x, wq, w_scale, bias, rowwise)
    return simulate(x, wq, w_scale, bias, rowwise)


@fp8_linear.register_fake
def _fake(x, wq, w_scale, bias, rowwise):
    return x.new_empty((*x.shape[:-1], wq.shape[0]))
