"""int8 Linear with dynamically quantised int8 inputs: the kernel in ATen ops, and the
same math registered as the op `opswap::int8_linear`.

The math (symmetric, no zero points):

- weights, once, per output channel n: `w_scale[n] = max_k |W[n, k]| / 127`,
  `Wq = round(W / w_scale)` in int8, stored transposed `[K, N]`;
- inputs, on every call, per row m (per token): `x_scale[m] = max_k |x[m, k]| / 127`,
  `xq = round(x / x_scale)` in int8;
- `y = (xq @ Wq) * x_scale[:, None] * w_scale[None, :] + bias`, the product accumulated
  in int32 (exact), then scaled in float32.

Each rounding errs by at most half a step, so a row's relative error is bounded by the
int8 step over the row's largest value; on random and trained-like weights the output's
relative L2 error is about 0.9% per layer (measured in the tests). Per-row input scales
keep one outlier token from costing the other tokens their precision.

Kernels:

- CPU and CUDA: `torch._int_mm` (oneDNN's VNNI/AMX kernels on x86, cuBLASLt's int8
  Tensor Core GEMM on CUDA, which needs M > 16 and K, N multiples of 8) between the
  quantise and rescale steps written as a few in-place tensor ops;
- anywhere `_int_mm` does not take the shape: the reference, the same integer math in
  float32 (exact while `127 * 127 * K < 2**24`, K <= 1040; above, float rounding of the
  sum differs from the int32 sum by a relative 6e-8).

The module precision.int8_linear installs (rules/precision/_int8_module.py) runs
`direct`, whose ATen ops torch.export keeps and torch.compile fuses; the registered op is
one opaque node for callers that want the layer as a single op in their graph (with a
fake implementation, so export and compile accept it), at the cost of Inductor not
fusing its steps (2.09x against 2.52x compiled on the MLP measured in the module's notes).

Why it is faster: the weight moves 1 byte per element instead of 4, and the GEMM runs
at the int8 rate (the 2-core development VM measures 1074 GOP/s int8 against 263 GFLOP/s
float32 at 1024^3); the price is about 10 elementwise passes over the M x K input and the
M x N output, which is why tiny layers and single rows lose. Measured per shape there
(benchmarks/results/int8_linear_cpu.json, eager): 64 x 768 -> 768 1.92x, 256 x 768 ->
3072 2.53x, 512 x 4096 -> 4096 3.25x, 2048 x 768 -> 768 1.82x; 1 x 768 -> 768 0.51x.
"""

from __future__ import annotations

import torch

_QMAX = 127.0


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wq transposed to [K, N] int8, w_scale [N] float32) for a Linear weight [N, K]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / _QMAX
    q = torch.round(w / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q.t().contiguous(), scale


# The largest finite step: x / step stays inf for an inf element and 0 for finite ones.
_MAX_STEP = torch.finfo(torch.float32).max / _QMAX


def _quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, the scale that rescales them). A row holding +-inf keeps scale inf and
    is quantised with the largest finite step, so its inf elements become +-127 and its
    finite ones 0: the output is +-inf with float32's sign of inf * w (NaN where w is held
    as 0, as inf * 0 is), not the all-NaN of inf / inf. A NaN row has scale NaN: all NaN,
    as in float32. Both cost one [M, 1] clamp, not a pass over the input."""
    scale = x2.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(_QMAX)
    q = (x2 / scale.clamp_max(_MAX_STEP)).round_().clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def _rescale(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    y = acc.to(torch.float32).mul_(x_scale).mul_(w_scale)
    return y.add_(bias) if bias is not None else y


def reference(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The op's math with the integer product done in float32: what every kernel matches."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()
    q, s = _quantize_rows(x2)
    y = _rescale(q.float() @ wq.float(), s, w_scale, bias)
    return y.reshape(*lead, wq.shape[1]).to(x.dtype)


def cpu_int_mm_fast() -> bool:
    """Whether `torch._int_mm` runs an int8 kernel on this CPU. With VNNI or AMX it runs
    oneDNN's; without, it falls back to a loop that ran at 1.9 GOP/s on an AVX2 EPYC
    against 67 GFLOP/s float32 at 1024^3, so there the integer math runs as float32
    products of the int8 values (the reference): exact while 127 * 127 * K < 2**24, no
    faster than float32, and the rule's timing says so and plans no site."""
    from opswap.kernels.int8_static import has_vnni

    return has_vnni()


def _int_mm_ok(m: int, k: int, n: int, device: torch.device) -> bool:
    if device.type == "cuda":
        return m > 16 and k % 8 == 0 and n % 8 == 0
    return device.type == "cpu" and m > 0 and cpu_int_mm_fast()


def direct(x, wq, w_scale, bias) -> torch.Tensor:
    """The kernel as ATen ops: what Int8Linear runs, eagerly and when traced."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not _int_mm_ok(x2.shape[0], k, wq.shape[1], x.device):
        return reference(x, wq, w_scale, bias)
    q, s = _quantize_rows(x2)
    y = _rescale(torch._int_mm(q, wq), s, w_scale, bias)
    return y.reshape(*lead, wq.shape[1]).to(x.dtype)


@torch.library.custom_op("opswap::int8_linear", mutates_args=())
def int8_linear(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ dequant(wq) with x quantised to int8 per row on the fly; wq is [K, N] int8."""
    return direct(x, wq, w_scale, bias)


@int8_linear.register_fake
def _fake(x, wq, w_scale, bias):
    return x.new_empty((*x.shape[:-1], wq.shape[1]))
