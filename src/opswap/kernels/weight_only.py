"""Weight-only INT8 and INT4 Linear: `y = x @ dequant(Wq)^T + b` with the weight stored in
8 or 4 bits and the activations left in bfloat16/float16, registered as the op
`opswap::wo_linear`.

Why it is faster: a Linear run on a few rows (decoding: one token per sequence) is
memory-bound; its time is the weight's bytes over the memory bandwidth. An INT8 weight
moves half the bytes of a bfloat16 one, an INT4 weight a quarter plus its scales (with
groups of 128, 8 bytes of fp32 scale and offset per 64 bytes of packed weight: 0.5625
bytes per weight, 3.56x fewer than bfloat16). On an H200 (4.8 TB/s on the datasheet,
about 4.3 measured by a copy) the 2048 -> 5632 Linear of a 1.1B Llama moves 23 MB in
bfloat16 (5.4 us) and 6.5 MB in INT4 (1.5 us). At thousands of rows (prefill) the GEMM
is compute-bound and the weight's bytes do not matter: there the op dequantises and calls
cuBLAS, which is slower than keeping the weight in bfloat16; the rules take these layers
only where the example runs on few rows.

The math (per output channel n and group g of `group_size` consecutive input features):

- INT8, symmetric, no zero point: `s[n, g] = max |W[n, g]| / 127`,
  `q = round(W / s)` in [-127, 127], `W ~ q * s`. Trained weights are centred on zero
  per channel, and with 255 levels a zero point would buy under a tenth of a bit;
  without it the dequantisation is one multiply, applied once per group to the dot
  product rather than per weight. Default: one group per channel (group_size = K).
- INT4, asymmetric (a zero offset per group): `s = (max - min) / 15`, `m = min`,
  `q = round((W - m) / s)` in [0, 15], `W ~ q * s + m`. With 16 levels, spending one on
  a range that is not symmetric costs a tenth of the precision; the min/max form uses
  all 16 on the group's actual range, the error GPTQ/AWQ-style int4 schemes keep.
  Default: groups of 128.

Both forms are applied to the dot product, not to each weight:
`x . W[n, g] = s[n, g] * (x_g . q[n, g]) + m[n, g] * sum(x_g)`, so the kernel multiplies
raw integers (exact in bfloat16) and pays two FMAs per group and column. K is padded to
a multiple of group_size with zero weights at quantisation (the padded inputs are masked
to zero); INT4 is packed two per byte along K, the even k in the low nibble.

Storage (the module's buffers): `qweight` [N, Kp] int8 or [N, Kp / 2] uint8, `scale`
[N, Kp / G] float32, `offset` [N, Kp / G] float32 (INT4 only). The kernels and `reference`
also take scale and offset in bfloat16 (converted on load).

Kernels, by device and rows:

- CUDA, bfloat16/float16, INT4 at one row, when INT4_GEMV_DEFAULT is on (the default,
  measured faster than `_wo_kernel` at every Llama shape): `_int4_gemv`, which reads the codes as 32-bit
  words and makes each a float with one AND (a subnormal, x pre-scaled per code position):
  no int -> float conversion; its comment gives the design and the instruction arithmetic.
- CUDA, bfloat16/float16, other cases up to 16 rows: `_wo_kernel`, our Triton GEMV /
  skinny GEMM. Each program owns BLOCK_N output columns and a share of K (split-K, so
  that the 128 or so column tiles of a 2048-wide layer still put several programs on each
  of the 132 multiprocessors and keep enough loads in flight); it loads the packed tile,
  unpacks in registers, and either reduces with `tl.sum` (M = 1; with grouped weights a
  chunk holds several whole groups, reshaped to [BLOCK_N, groups, group] and summed per
  group) or feeds `tl.dot` with M padded to 16 (the tensor cores have the arithmetic to
  spare). Partial sums go to an fp32 workspace; the last program of a column tile to
  finish (an atomic counter, reset by that program, so no memset runs per call) adds them
  in a fixed order, adds the bias and writes the output: one launch per Linear,
  deterministic. Block sizes and the split are tuned by `triton.autotune` per shape on
  first use (`_int4_gemv` likewise).
- CUDA, more rows or float32: dequantise to the activation dtype, then `F.linear` (cuBLAS).
- CPU: INT8 per channel through `aten._weight_int8pack_mm`; otherwise dequantise and
  `F.linear`, so the op runs everywhere.

`reference` is the same function in float64.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from opswap.errors import OpswapError
from opswap.kernels._tables import merge_entries, read_entries

try:  # Triton is optional: without it the op runs its dequantise + F.linear path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported environment has Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

#: rows up to which the Triton kernel runs (measured: 1 and 16 rows, benchmarks/gpu_suite.py)
TRITON_MAX_ROWS = 16
#: INT4 at one row through `_int4_gemv` by default: on the H200 it took 3.5, 2.4, 5.3 and
#: 6.6 us on TinyLlama's four shapes against the general kernel's 4.8, 2.7, 7.3 and 8.8,
#: and the 154 Linears of the model 0.670 ms against 0.869 (results/lowbit_h200.json,
#: 2026-12-05; `gpu_suite.py --only lowbit` times both)
INT4_GEMV_DEFAULT = True
#: launch `_int4_gemv` as a programmatic dependent launch on Hopper and later (sm_90+):
#: its first weight loads then overlap the end of the kernel before it in the stream. On
#: an H100 (results/lowbit_h100.log, 2026-12-05) the 154 Linears of the 1.1B Llama at one
#: row took 0.564 ms with it against 0.702 without (bf16 1.249, tinygemm 0.694): 2.21x
#: bf16 instead of 1.78x, the same outputs to the bit
INT4_PDL = True
#: the largest split-K any tuned configuration uses (the workspace is sized for it)
MAX_SPLIT_K = 8
_INT8_MAX = 127.0
_INT4_LEVELS = 15.0


class WeightOnlyError(OpswapError, ValueError):
    """A weight or setting the weight-only Linear cannot take."""


def default_group_size(bits: int, in_features: int) -> int:
    """128 for INT4; one group per output channel (the whole row) for INT8."""
    return 128 if bits == 4 else in_features


def _check(bits: int, group_size: int, in_features: int) -> None:
    if bits not in (4, 8):
        raise WeightOnlyError(f"bits must be 4 or 8 for a weight-only Linear; got {bits}.")
    per_channel = group_size == in_features
    if not per_channel and (group_size < 32 or group_size & (group_size - 1)):
        raise WeightOnlyError(
            f"group_size {group_size} must be a power of two of at least 32, or the whole "
            f"row ({in_features}); pick 32, 64, 128 or 256."
        )
    if bits == 4 and per_channel and in_features % 2:
        raise WeightOnlyError(
            f"INT4 per channel needs an even number of input features, not {in_features}; "
            "use group_size=128 (K is then padded)."
        )


def padded_k(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


def quantize(
    weight: torch.Tensor, bits: int, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(qweight, scale, offset or None, group_size) for a Linear weight [N, K]; see the
    module's docstring for the layout. Computed in float32 on the weight's device."""
    n, k = weight.shape
    g = default_group_size(bits, k) if group_size is None else int(group_size)
    _check(bits, g, k)
    kp = padded_k(k, g)
    w = weight.detach().float()
    if kp != k:
        w = F.pad(w, (0, kp - k))
    w = w.reshape(n, kp // g, g)
    if bits == 8:
        scale = w.abs().amax(dim=2).clamp_min(1e-12) / _INT8_MAX
        q = torch.round(w / scale[..., None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        return q.reshape(n, kp).contiguous(), scale.contiguous(), None, g
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = ((hi - lo) / _INT4_LEVELS).clamp_min(1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, _INT4_LEVELS)
    q = q.to(torch.uint8).reshape(n, kp // 2, 2)
    packed = (q[..., 0] | (q[..., 1] << 4)).contiguous()
    return packed, scale.contiguous(), lo.contiguous(), g


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, Kp / 2] uint8 -> [N, Kp] uint8 codes in [0, 15]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bits: int,
    in_features: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight [N, K] the stored codes stand for, in `dtype` (computed in float32, or
    float64 when `dtype` is float64)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    codes = unpack_int4(qweight) if bits == 4 else qweight
    n, kp = codes.shape
    ng = scale.shape[1]
    w = codes.to(work).reshape(n, ng, kp // ng) * scale.to(work)[..., None]
    if offset is not None:
        w = w + offset.to(work)[..., None]
    return w.reshape(n, kp)[:, :in_features].to(dtype)


def reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    in_features: int,
) -> torch.Tensor:
    """The op's function in float64 (returned in float64): what every kernel is checked
    against."""
    w = dequantize(qweight, scale, offset, bits, in_features, torch.float64)
    y = x.double() @ w.t()
    return y + bias.double() if bias is not None else y


# ----------------------------------------------------------------------------- the kernel


def _plus_bias_fn(acc, b_ptr, rn, n_ok, BLOCK_M: tl.constexpr):
    """acc ([BLOCK_N] for one row, else [BLOCK_M, BLOCK_N]) plus the bias of columns rn."""
    b = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        acc += b
    else:
        acc += b[None, :]
    return acc


# jitted where it is defined, under the name the kernel calls (see _int4_load below)
_plus_bias: Any = triton.jit(_plus_bias_fn) if triton is not None else None


def _wo_kernel_fn(
    x_ptr,  # [M, K] bf16/fp16, row stride stride_xm, unit column stride
    w_ptr,  # [N, Kp] int8 or [N, Kp / 2] uint8, row stride stride_wn
    s_ptr,  # [N, groups] fp32
    o_ptr,  # [N, groups] fp32 (INT4) or s_ptr again (unused)
    b_ptr,  # [N] or x_ptr again (unused)
    y_ptr,  # [M, N] in x's dtype
    ws_ptr,  # [SPLIT_K, M, N] fp32 partial sums (split-K only)
    cnt_ptr,  # int32 counters, zero between launches (split-K only)
    M,
    N,
    K,
    Kp,
    stride_xm,
    stride_wn,
    stride_sn,
    BITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP at one row, GROUP at more, free if PER_CHANNEL
    GROUP: tl.constexpr,  # the group size (unused if PER_CHANNEL)
    SPLIT_K: tl.constexpr,
    DOT_F32: tl.constexpr,  # the interpreter's bfloat16 tl.dot is wrong (Triton 3.9): fp32 there
):
    # Bytes per output column: K / 2 (INT4) or K (INT8) of weight, read once; x (a few
    # rows) stays in L1/L2. Everything else is registers: the kernel is a weight stream.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    HALF: tl.constexpr = BLOCK_K // 2 if BITS == 4 else BLOCK_K
    rj = tl.arange(0, HALF)
    chunks = tl.cdiv(Kp, BLOCK_K)
    per = tl.cdiv(chunks, SPLIT_K)
    c0 = pid_k * per
    c1 = tl.minimum(c0 + per, chunks)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        xsum = tl.zeros((1,), dtype=tl.float32)
        x_row = x_ptr + pid_m * stride_xm
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    NG: tl.constexpr = 1 if PER_CHANNEL else BLOCK_K // GROUP  # groups per chunk
    for c in range(c0, c1):
        k0 = c * BLOCK_K
        if BLOCK_M == 1 and not PER_CHANNEL:
            # one row, NG whole groups per chunk (BLOCK_K divides Kp: no mask along K on the
            # weight, so its loads stay 16-byte vectors): per column and group, the integer
            # dot product, then its scale (and offset times the group's sum of x)
            gk = c * NG + tl.arange(0, NG)
            s = tl.load(
                s_ptr + rn[:, None] * stride_sn + gk[None, :], mask=n_ok[:, None], other=0.0
            )
            if BITS == 4:
                wq = tl.load(
                    w_ptr + rn[:, None] * stride_wn + (k0 // 2 + rj)[None, :],
                    mask=n_ok[:, None],
                    other=0,
                )
                ke = k0 + 2 * rj
                xe = tl.load(x_row + ke, mask=ke < K, other=0.0).to(tl.float32)
                xo = tl.load(x_row + ke + 1, mask=ke + 1 < K, other=0.0).to(tl.float32)
                p = (wq & 0xF).to(tl.float32) * xe[None, :] + (wq >> 4).to(tl.float32) * xo[None, :]
                pg = tl.sum(tl.reshape(p, (BLOCK_N, NG, GROUP // 2)), 2)  # [BLOCK_N, NG]
                xg = tl.sum(tl.reshape(xe + xo, (NG, GROUP // 2)), 1)  # [NG]
                off = tl.load(
                    o_ptr + rn[:, None] * stride_sn + gk[None, :], mask=n_ok[:, None], other=0.0
                )
                acc += tl.sum(pg * s + xg[None, :] * off, 1)
            else:
                kk = k0 + rj
                wq = tl.load(
                    w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None], other=0
                )
                xv = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
                pg = tl.sum(tl.reshape(wq.to(tl.float32) * xv[None, :], (BLOCK_N, NG, GROUP)), 2)
                acc += tl.sum(pg * s, 1)
        elif BITS == 4:
            wq = tl.load(
                w_ptr + rn[:, None] * stride_wn + (k0 // 2 + rj)[None, :],
                mask=n_ok[:, None],
                other=0,
            )
            lo = wq & 0xF
            hi = wq >> 4
            ke = k0 + 2 * rj
            ko = ke + 1
            if BLOCK_M == 1:
                xe = tl.load(x_row + ke, mask=ke < K, other=0.0).to(tl.float32)
                xo = tl.load(x_row + ko, mask=ko < K, other=0.0).to(tl.float32)
                part = tl.sum(lo.to(tl.float32) * xe[None, :], 1)
                part += tl.sum(hi.to(tl.float32) * xo[None, :], 1)
                xs = tl.sum(xe, 0) + tl.sum(xo, 0)
            else:
                xe = tl.load(
                    x_ptr + rm[:, None] * stride_xm + ke[None, :],
                    mask=m_ok[:, None] & (ke < K)[None, :],
                    other=0.0,
                )
                xo = tl.load(
                    x_ptr + rm[:, None] * stride_xm + ko[None, :],
                    mask=m_ok[:, None] & (ko < K)[None, :],
                    other=0.0,
                )
                if DOT_F32:
                    part = tl.dot(
                        xe.to(tl.float32), tl.trans(lo.to(tl.float32)), input_precision="ieee"
                    )
                    part += tl.dot(
                        xo.to(tl.float32), tl.trans(hi.to(tl.float32)), input_precision="ieee"
                    )
                else:
                    part = tl.dot(xe, tl.trans(lo.to(xe.dtype)))
                    part += tl.dot(xo, tl.trans(hi.to(xo.dtype)))
                xs = tl.sum(xe.to(tl.float32), 1) + tl.sum(xo.to(tl.float32), 1)
        else:
            kk = k0 + rj
            wq = tl.load(
                w_ptr + rn[:, None] * stride_wn + kk[None, :],
                mask=n_ok[:, None] & (kk < Kp)[None, :],
                other=0,
            )
            if BLOCK_M == 1:
                xv = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
                part = tl.sum(wq.to(tl.float32) * xv[None, :], 1)
                xs = tl.sum(xv, 0)
            else:
                xv = tl.load(
                    x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & (kk < K)[None, :],
                    other=0.0,
                )
                if DOT_F32:
                    part = tl.dot(
                        xv.to(tl.float32), tl.trans(wq.to(tl.float32)), input_precision="ieee"
                    )
                else:
                    part = tl.dot(xv, tl.trans(wq.to(xv.dtype)))
                xs = tl.sum(xv.to(tl.float32), 1)
        if PER_CHANNEL:
            acc += part
            xsum += xs
        elif BLOCK_M > 1:  # chunk c is group c: its scale (and offset) per column
            s = tl.load(s_ptr + rn * stride_sn + c, mask=n_ok, other=0.0)
            acc += part * s[None, :]
            if BITS == 4:
                m = tl.load(o_ptr + rn * stride_sn + c, mask=n_ok, other=0.0)
                acc += xs[:, None] * m[None, :]
    if PER_CHANNEL:  # one group: scale and offset applied once, by the program holding k = 0
        s = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0)
        if BLOCK_M == 1:
            acc = acc * s
            if BITS == 4:
                acc += xsum * tl.load(o_ptr + rn * stride_sn, mask=n_ok, other=0.0)
        else:
            acc = acc * s[None, :]
            if BITS == 4:
                m = tl.load(o_ptr + rn * stride_sn, mask=n_ok, other=0.0)
                acc += xsum[:, None] * m[None, :]
    if BLOCK_M == 1:
        out_off = pid_m * N + rn
        out_ok = n_ok
    else:
        out_off = rm[:, None] * N + rn[None, :]
        out_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = _plus_bias(acc, b_ptr, rn, n_ok, BLOCK_M)
        tl.store(y_ptr + out_off, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(ws_ptr + pid_k * M * N + out_off, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: add the partials in order
            if BLOCK_M == 1:
                tot = tl.zeros((BLOCK_N,), dtype=tl.float32)
            else:
                tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for p in range(SPLIT_K):
                tot += tl.load(
                    ws_ptr + p * M * N + out_off, mask=out_ok, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                tot = _plus_bias(tot, b_ptr, rn, n_ok, BLOCK_M)
            tl.store(y_ptr + out_off, tot.to(y_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch


# The INT4 GEMV of decoding (one row of x), `_int4_gemv`. Bytes: half a byte a code plus 8
# bytes of fp32 scale and offset per group of 128, 0.5625 B a code. At 4.2 TB/s an H200
# (132 SMs, 1.98 GHz) must retire 4.2e12 / 0.5625 / (132 * 1.98e9) = 28.6 codes per SM
# and clock, and an SM issues 128 thread-instructions a clock: at most 4.5 instructions per
# code, of which at most 2.2 on the integer pipe (LOP3 and shifts, 64 a clock). `_wo_kernel`
# spends 7.4 SASS instructions per code in its one-row loop (Triton 3.6, sm_90; 7.1 with
# 3.9), among them an I2F per code, which issues at 16 a clock: that alone caps it at 16
# codes a clock, 2.4 TB/s. Here, with no conversion instruction at all:
#
# - The codes are read as 32-bit words (the uint8 buffer viewed as int32, the same bytes:
#   code 8j + i in bits 4i..4i+3 of word j), 16 bytes (one unit, 32 codes) a thread a row.
# - A code kept in place with one AND, every other bit cleared, is the fp32 value
#   q * 2^(4e - 149) for bits 4e..4e+3 (a subnormal: exponent field 0, q * 2^4e in the
#   mantissa). Codes 0..4 lie in the mantissa where they are; 5..7 after one shift by 12
#   (7 would reach the sign bit), e = 2..4. x is scaled once per chunk by 2^(149 - e - D),
#   so an FFMA adds q * x * 2^-D, exactly the product of two floats: no offset to take back
#   out, no cancellation (the `1 + q / 16` form, exponent bits OR-ed in, costs a shift per
#   code and a correction per word: 1244 instructions against 889 in an earlier form of
#   this loop, Triton 3.9). Per word: 1 shift + 8 AND + 8 FFMA, 2.1 instructions a code,
#   1.1 of them integer. FFMA takes subnormals at full rate; the PTX has no .ftz (a test
#   checks it, and that there is no I2F).
#   Range: x * 2^85 overflows for |x| >= 2^43; |x| < 2^-62 loses bits to subnormals.
# - Per unit: acc += s * p + m * sum(x) (2^-D folded in), with s and m loaded per unit (a
#   group's 4 units read the same address); acc [BLOCK_N, BLOCK_U] is reduced once, after
#   the last chunk, and multiplied by 2^D.
# - x is loaded once per chunk as 16-byte vectors, each element by one thread, then
#   exchanged through shared memory so that each thread holds the 32 values of its unit,
#   shared by the BLOCK_N * BLOCK_U / (32 * warps) rows it owns (the reshape, broadcast and
#   splits below keep every axis of a word in-thread: no shuffles, no sum per group).
# - Launched as a programmatic dependent launch (Hopper), a program loads the codes, scales
#   and offsets of its first PREFETCH + 1 chunks before it waits for the kernel before:
#   only x is written by that kernel. With the scales loaded after the wait, every Linear
#   spent a trip to memory after the kernel before had finished: the 154 Linears of the
#   1.1B Llama at one row took 0.508 ms against 0.444 now on an H100 (bf16 1.244 ms;
#   results/tune_int4_ab_h100.json, both kernels on their own measured launches).
#
# The compiled loop at BLOCK_N 16, BLOCK_U 64, 4 warps (a 2048-wide row in one chunk, 256
# codes a thread): 840 instructions with Triton 3.6 (864 with 3.9), 3.3 a code: 256 LOP3,
# 240 FFMA + 16 FMUL for the codes, 10 LDG.E.128, no I2F, 168 registers (3 programs an SM).
# Issue then allows 39 codes a clock (5.7 TB/s-equivalent), so the bytes, not the
# instructions, should set the time. Split-K, the workspace and the counters are
# `_wo_kernel`'s.

#: 2^D: the INT4 GEMV's partial sums are kept at 2^-D times their value
_INT4_D = tl.constexpr(64) if tl is not None else 64


def _int4_load_fn(
    w_rows,
    s_cols,
    o_cols,
    c,
    c1,
    KW,
    BLOCK_U: tl.constexpr,
    GROUP: tl.constexpr,
):
    # chunk c's weights [BLOCK_N, 4 BLOCK_U] (int32 words) and its units' scales and
    # offsets [BLOCK_N, BLOCK_U]; a chunk at or past c1 (the program's end) loads nothing.
    # None of it is written by an earlier kernel, so all of it may load before gdc_wait.
    j = c * (4 * BLOCK_U) + tl.arange(0, 4 * BLOCK_U)
    w = tl.load(w_rows + j[None, :], mask=(j < tl.where(c < c1, KW, 0))[None, :], other=0)
    g = ((c * BLOCK_U + tl.arange(0, BLOCK_U)) * 32) // GROUP
    gm = (g < tl.where(c < c1, (KW * 8) // GROUP, 0))[:, None]
    # loaded as [BLOCK_U, BLOCK_N] and transposed: Triton 3.6 then lays s out as acc is
    # (lanes along the units); a [BLOCK_N, BLOCK_U] load put its lanes along the rows
    # and cost a shared-memory exchange of acc every chunk (912 instructions, not 840)
    s = tl.trans(tl.load(s_cols + g[:, None], mask=gm, other=0.0).to(tl.float32))
    m = tl.trans(tl.load(o_cols + g[:, None], mask=gm, other=0.0).to(tl.float32))
    return w, s, m


def _int4_chunk_fn(
    acc,
    w,
    s,
    m,
    c,
    x_row,
    K,
    xf,
    BLOCK_N: tl.constexpr,
    BLOCK_U: tl.constexpr,
):
    # one chunk of `_int4_gemv`: w [BLOCK_N, 4 BLOCK_U] int32 words, s and m [BLOCK_N,
    # BLOCK_U], all loaded (`_int4_load`); x is read here, after any wait
    rk = tl.arange(0, 32 * BLOCK_U)
    w = tl.reshape(w.to(tl.uint32, bitcast=True), (BLOCK_N, BLOCK_U, 4))  # 16 B a unit
    k = c * (32 * BLOCK_U) + rk
    xv = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
    xv = tl.reshape(xv, (BLOCK_U, 4, 8))  # [u, v, i]: code i of word 4u + v
    xu = tl.sum(tl.sum(xv, 2), 1)  # [BLOCK_U]: x summed over the unit
    # x's value for each code of each word, scaled, broadcast over the rows and split
    # apart along in-thread axes ([a, b, c] of the reshape is code 4a + 2b + c)
    xr = tl.reshape(xv * xf[None, None, :], (BLOCK_U, 4, 2, 2, 2))
    xb = tl.broadcast_to(xr[None, :, :, :, :, :], (BLOCK_N, BLOCK_U, 4, 2, 2, 2))
    ev, od = tl.split(xb)  # c = 0, 1
    e0, e1 = tl.split(ev)  # b = 0, 1
    o0, o1 = tl.split(od)
    x0, x4 = tl.split(e0)  # a = 0, 1
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    w12 = w >> 12  # codes 5, 6, 7 to bits 8..19 (in place, 7 would reach the sign bit)
    p = (w & 0xF).to(tl.float32, bitcast=True) * x0
    p += (w & 0xF0).to(tl.float32, bitcast=True) * x1
    p += (w & 0xF00).to(tl.float32, bitcast=True) * x2
    p += (w & 0xF000).to(tl.float32, bitcast=True) * x3
    p += (w & 0xF0000).to(tl.float32, bitcast=True) * x4
    p += (w12 & 0xF00).to(tl.float32, bitcast=True) * x5
    p += (w12 & 0xF000).to(tl.float32, bitcast=True) * x6
    p += (w12 & 0xF0000).to(tl.float32, bitcast=True) * x7
    acc += m * (xu * (2.0**-_INT4_D))[None, :]
    acc += s * tl.sum(p, 2)
    return acc


# a helper the kernel calls is jitted where it is defined, under the name the kernel calls
# (as `_rows.rn`): the interpreter and the compiler both resolve it by that global
_int4_load: Any = triton.jit(_int4_load_fn) if triton is not None else None
_int4_chunk: Any = triton.jit(_int4_chunk_fn) if triton is not None else None


def _int4_gemv_fn(
    x_ptr,  # [M, K] bf16/fp16, row stride stride_xm, unit column stride: one row a program
    w_ptr,  # [N, KW] int32: the packed codes read as words, code k = 8 j + i in bits 4i..4i+3
    s_ptr,  # [N, groups] scale (fp32 or bf16)
    o_ptr,  # [N, groups] offset (fp32 or bf16)
    b_ptr,  # [N] or x_ptr again (unused)
    y_ptr,  # [M, N] in x's dtype
    ws_ptr,  # [SPLIT_K, M, N] fp32 partial sums (split-K only)
    cnt_ptr,  # int32 counters, zero between launches (split-K only)
    M,
    N,
    K,
    KW,  # words a row: Kp / 8 (a multiple of 4)
    stride_xm,
    stride_wn,
    stride_sn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_U: tl.constexpr,  # units of 4 words (32 codes, 16 bytes) a chunk
    GROUP: tl.constexpr,  # a multiple of 32: a unit lies in one group
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (Hopper and later)
    PREFETCH: tl.constexpr,  # chunks loaded ahead of the one computed: 0, 1 or 2
):
    if PDL:
        # let the next kernel of the stream start its own weight loads once every program
        # of this one is resident; it waits (gdc_wait) before it reads what we write
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rnc = tl.minimum(rn, N - 1)  # rows past N read row N - 1 (not stored): no mask
    ri = tl.arange(0, 8)
    units = KW // 4
    chunks = tl.cdiv(units, BLOCK_U)
    per = tl.cdiv(chunks, SPLIT_K)
    c0 = pid_k * per
    c1 = tl.minimum(c0 + per, chunks)
    x_row = x_ptr + pid_m * stride_xm
    w_rows = w_ptr + rnc[:, None] * stride_wn
    s_cols = s_ptr + rnc[None, :] * stride_sn
    o_cols = o_ptr + rnc[None, :] * stride_sn
    # x's factor for code i: 2^(149 - e - D), e = 4i (i < 5) or 4 (i - 3) (shifted codes)
    e = 4 * (ri - 3 * (ri // 5))
    xf = ((276 - e - _INT4_D) << 23).to(tl.float32, bitcast=True)
    acc = tl.zeros((BLOCK_N, BLOCK_U), dtype=tl.float32)
    # the first PREFETCH + 1 chunks (weights, scales and offsets) are loaded before
    # anything an earlier kernel writes is read: under PDL those loads overlap the end of
    # the kernel before (none of it is written by it), and only x, the one input a
    # previous kernel makes, and what comes after wait for it. Later chunks are loaded
    # PREFETCH ahead of the one computed (PREFETCH + 1 chunks in registers). A chunk past
    # the program's share loads nothing.
    w, s, m = _int4_load(w_rows, s_cols, o_cols, c0, c1, KW, BLOCK_U, GROUP)
    if PREFETCH >= 1:
        w1, s1, m1 = _int4_load(w_rows, s_cols, o_cols, c0 + 1, c1, KW, BLOCK_U, GROUP)
    if PREFETCH >= 2:
        w2, s2, m2 = _int4_load(w_rows, s_cols, o_cols, c0 + 2, c1, KW, BLOCK_U, GROUP)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = _int4_chunk(acc, w, s, m, c0, x_row, K, xf, BLOCK_N, BLOCK_U)
    for c in range(c0 + 1, c1):
        if PREFETCH >= 2:
            w, s, m = w1, s1, m1
            w1, s1, m1 = w2, s2, m2
            w2, s2, m2 = _int4_load(w_rows, s_cols, o_cols, c + 2, c1, KW, BLOCK_U, GROUP)
        elif PREFETCH == 1:
            w, s, m = w1, s1, m1
            w1, s1, m1 = _int4_load(w_rows, s_cols, o_cols, c + 1, c1, KW, BLOCK_U, GROUP)
        else:
            w, s, m = _int4_load(w_rows, s_cols, o_cols, c, c1, KW, BLOCK_U, GROUP)
        acc = _int4_chunk(acc, w, s, m, c, x_row, K, xf, BLOCK_N, BLOCK_U)
    out = tl.sum(acc, 1) * (2.0**_INT4_D)
    out_off = pid_m * N + rn
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + out_off, out.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(ws_ptr + pid_k * M * N + out_off, out, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: add the partials in order
            tot = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for sk in range(SPLIT_K):
                tot += tl.load(
                    ws_ptr + sk * M * N + out_off, mask=n_ok, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                tot += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + out_off, tot.to(y_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch


#: the kernels' uses, each autotuned apart: `_wo_kernel` for weights per channel (any rows),
#: grouped weights at more than one row (a chunk is one group, through tl.dot) and grouped
#: INT8 at one row (a chunk is several groups); `_int4_gemv` for INT4 at one row
KINDS = ("per_channel", "grouped", "gemv", "int4_gemv")


def _configs(kind: str) -> list[Any]:
    """The block shapes and splits `triton.autotune` tries (per shape, on first use)."""
    out = []
    if kind == "gemv":
        # tiles of 1 to 16 KB of packed weight a chunk; at K = 2048 the largest chunk is
        # the whole row, one load per program and one reduction
        for bn in (4, 8, 16, 32):
            for bk in (256, 512, 1024, 2048):
                if not 1024 <= bn * bk // 2 <= 16384:
                    continue
                tile = bn * bk // 2
                warps = (2, 4) if tile <= 4096 else (4, 8)
                for split in (1, 2, 4):
                    for nw in warps:
                        kw = {"BLOCK_N": bn, "SPLIT_K": split, "BLOCK_K": bk}
                        out.append(triton.Config(kw, num_warps=nw, num_stages=3))
        return out
    shapes = [(16, 1), (16, 4), (32, 2), (32, 4), (64, 1), (16, 8), (32, 1), (64, 2)]
    ks: tuple[int | None, ...] = (256, 512) if kind == "per_channel" else (None,)
    for bn, split in shapes:
        for chunk in ks:
            kw2: dict[str, int] = {"BLOCK_N": bn, "SPLIT_K": split}
            if chunk is not None:
                kw2["BLOCK_K"] = chunk
            out.append(triton.Config(kw2, num_warps=4, num_stages=3))
    return out


#: `_int4_gemv`'s tiles (BLOCK_N, BLOCK_U, warps): each thread holds one unit (16 bytes,
#: 32 codes) of R = BLOCK_N * BLOCK_U / (32 * warps) rows, R = 4 or 8 (8 rows take about
#: 170 registers, 3 programs of 4 warps an SM); BLOCK_U 64 is a 2048-wide row in one chunk
INT4_TILES = (
    (8, 32, 2),
    (8, 64, 2),
    (8, 64, 4),
    (16, 32, 2),
    (16, 32, 4),
    (16, 64, 4),
    (16, 64, 8),
    (32, 16, 2),
    (32, 32, 4),
    (32, 64, 8),
)


def _int4_configs(depths: tuple[int, ...] = (0, 1)) -> list[Any]:
    """INT4_TILES with split-K 1, 2 and 4, each prefetching `depths` chunks ahead (pruned
    per shape to the chunks there are). The autotuner tries 0 and 1; tune_int4.py, which
    writes the measured table, 2 as well."""
    return [
        triton.Config(
            {"BLOCK_N": bn, "BLOCK_U": bu, "SPLIT_K": split, "PREFETCH": pre},
            num_warps=nw,
            num_stages=1,
        )
        for bn, bu, nw in INT4_TILES
        for split in (1, 2, 4)
        for pre in depths
    ]


def _int4_fits(cfg: dict[str, Any], units: int) -> bool:
    """Whether an `_int4_gemv` configuration suits rows of `units` units: a chunk no wider
    than the row, no more splits than chunks, and prefetching d chunks ahead only where a
    program has more than d chunks (elsewhere it is the kernel of one less)."""
    bu, split = int(cfg["BLOCK_U"]), int(cfg.get("SPLIT_K", 1))
    chunks = -(-units // bu)
    return (
        bu <= max(units, 16)
        and split <= chunks
        and 0 <= int(cfg.get("PREFETCH", 0)) <= 2
        and -(-chunks // split) > int(cfg.get("PREFETCH", 0))
    )


def _prune_int4(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    units = int(named_args["KW"]) // 4
    keep = [c for c in configs if _int4_fits(c.kwargs, units)]
    fallback = {"BLOCK_N": 16, "BLOCK_U": 16, "SPLIT_K": 1, "PREFETCH": 0}
    return keep or [triton.Config(fallback, num_warps=4)]


def gemv_block_ok(block_k: int, group: int, kp: int) -> bool:
    """Whether the one-row grouped path can take chunks of `block_k`: whole groups, a
    power-of-two count of them, and whole chunks over the padded K (no mask along K)."""
    ng = block_k // group
    return block_k % group == 0 and ng & (ng - 1) == 0 and kp % block_k == 0


def _prune_gemv(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    group = int(kwargs["GROUP"] if "GROUP" in kwargs else named_args["GROUP"])
    kp = int(named_args["Kp"])
    chunks = {c.kwargs["BLOCK_K"]: kp // c.kwargs["BLOCK_K"] for c in configs}
    keep = [
        c
        for c in configs
        if gemv_block_ok(c.kwargs["BLOCK_K"], group, kp)
        and c.kwargs["SPLIT_K"] <= chunks[c.kwargs["BLOCK_K"]]
    ]
    if keep:
        return keep
    # no tried chunk fits this K: one group per chunk always does
    return [triton.Config({"BLOCK_N": 16, "SPLIT_K": 1, "BLOCK_K": group}, num_warps=4)]


_KERNELS: dict[tuple[str | None, bool], Any] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernel(kind: str | None) -> Any:
    """The jitted kernel, built on first use (the interpreter is chosen at decoration
    time, so tests can set TRITON_INTERPRET after opswap is imported): autotuned for one
    of KINDS on a GPU, or, for `kind=None` and in the interpreter, plain (the caller
    gives the configuration)."""
    key = (None if interpreting() else kind, interpreting())
    if kind == "int4_gemv" or kind == "int4_gemv_fixed":  # a kernel of its own
        key = (kind if not interpreting() else "int4_gemv_fixed", interpreting())
        if key not in _KERNELS:
            fn = triton.jit(_int4_gemv_fn)
            if key[0] == "int4_gemv":
                fn = triton.autotune(
                    _int4_configs(),
                    key=["M", "N", "K"],
                    prune_configs_by={"early_config_prune": _prune_int4},
                )(fn)
            _KERNELS[key] = fn
        return _KERNELS[key]
    if key not in _KERNELS:
        fn = triton.jit(_wo_kernel_fn)
        if key[0] is not None:
            prune = {"early_config_prune": _prune_gemv} if key[0] == "gemv" else None
            fn = triton.autotune(_configs(key[0]), key=["M", "N", "K"], prune_configs_by=prune)(fn)
        _KERNELS[key] = fn
    return _KERNELS[key]


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Split-K arrival counters for `device`, zero between launches (each tile's last
    program resets its own). Allocated once, on the first call, which must not be inside
    a CUDA graph capture (warm up first); calls on two streams at once would share them."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < tiles:
        have = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def triton_supported(x: torch.Tensor) -> str | None:
    """None when `_wo_kernel` can run on x, else why not (one sentence)."""
    if triton is None:
        return "Triton is not installed"
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        return f"x is on {x.device.type}; the Triton kernel runs on CUDA (or the interpreter)"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}; the Triton kernel takes bfloat16 or float16 activations"
    return None


def triton_wo_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    in_features: int,
    config: dict[str, int] | None = None,
    int4_gemv: bool | None = None,
) -> torch.Tensor:
    """`_int4_gemv` (INT4 at one row, where `int4_gemv_ok`) or `_wo_kernel` on x [..., K].
    `config` (BLOCK_N, SPLIT_K, BLOCK_K or BLOCK_U, num_warps) fixes the launch instead of
    autotuning; the interpreter always takes it (or a small default). `int4_gemv` sends
    INT4 at one row to `_int4_gemv` (True) or `_wo_kernel` (False); by default
    INT4_GEMV_DEFAULT decides."""
    why = triton_supported(x)
    if why is not None:
        raise WeightOnlyError(f"The weight-only Triton kernel cannot run: {why}.")
    lead, k = x.shape[:-1], x.shape[-1]
    if k != in_features:
        raise WeightOnlyError(f"x has {k} features; this weight takes {in_features}.")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qweight.shape[0]
    groups = scale.shape[1]
    kp = qweight.shape[1] * (2 if bits == 4 else 1)
    per_channel = groups == 1
    block_m = 1 if m == 1 else 16
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y.reshape(*lead, n)
    ws = torch.empty((MAX_SPLIT_K, m, n), device=x.device, dtype=torch.float32)
    cnt = _counters(x.device, -(-m // block_m) * -(-n // 8))  # tiles of 8 columns or more
    group = kp // groups
    if int4_gemv is None:
        int4_gemv = INT4_GEMV_DEFAULT
    if int4_gemv and bits == 4 and m == 1 and int4_gemv_ok(qweight, group):
        _int4_gemv(x2, qweight, scale, offset, bias, k, group, y, ws, cnt, config)
        return y.reshape(*lead, n)
    kind = "per_channel" if per_channel else ("gemv" if block_m == 1 else "grouped")
    kw: dict[str, Any] = {"BLOCK_M": block_m, "DOT_F32": interpreting(), "GROUP": group}
    if kind == "grouped":
        kw["BLOCK_K"] = group
    fixed = config if config is not None else (None if not interpreting() else {})
    if fixed is not None:
        default_k = 64 if kind == "per_channel" else group
        fixed = {"BLOCK_N": 16, "SPLIT_K": 2, **fixed}
        fixed.setdefault("BLOCK_K", default_k)
        if kind == "grouped":
            fixed.pop("BLOCK_K", None)
        elif kind == "gemv" and not gemv_block_ok(fixed["BLOCK_K"], group, kp):
            fixed["BLOCK_K"] = group
        kw.update(fixed)
        fn = _kernel(None)
    else:
        fn = _kernel(kind)

    def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], triton.cdiv(m, block_m))

    fn[grid](
        x2,
        qweight,
        scale,
        offset if offset is not None else scale,
        bias if bias is not None else x2,
        y,
        ws,
        cnt,
        m,
        n,
        k,
        kp,
        x2.stride(0),
        qweight.stride(0),
        scale.stride(0),
        BITS=bits,
        PER_CHANNEL=per_channel,
        HAS_BIAS=bias is not None,
        **kw,
    )
    return y.reshape(*lead, n)


def int4_gemv_ok(qweight: torch.Tensor, group: int) -> bool:
    """Whether `_int4_gemv` can read these INT4 codes as 32-bit words: groups a multiple of
    32 codes (a unit of 4 words lies in one group), rows of whole words, 4-byte aligned."""
    return (
        group % 32 == 0
        and qweight.dtype == torch.uint8
        and qweight.stride(-1) == 1
        and qweight.shape[1] % 4 == 0
        and qweight.stride(0) % 4 == 0
        and qweight.storage_offset() % 4 == 0
    )


def pdl_ok(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched as programmatic dependent launches:
    a CUDA GPU of compute capability 9.0 or later (not the interpreter)."""
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _int4_gemv(x2, qweight, scale, offset, bias, k, group, y, ws, cnt, config) -> None:
    """`_int4_gemv` on the rows of x2 [M, K] (a program row each) into y [M, N]. `config`
    (BLOCK_N, BLOCK_U, SPLIT_K, num_warps) fixes the launch; BLOCK_K (codes) is taken as
    BLOCK_U = BLOCK_K / 32, so the tests' configurations serve both kernels."""
    m, n = x2.shape[0], qweight.shape[0]
    words = qweight.view(torch.int32)  # the same bytes: [N, Kp / 8], code 8j + i in bits 4i..
    kw_total = words.shape[1]
    units = kw_total // 4
    pdl = pdl_ok(x2.device) and INT4_PDL
    fixed = config if config is not None else (None if not interpreting() else {})
    if fixed is None:
        fixed = int4_tile(x2.device, n, k, group, scale.dtype, pdl)
    kw: dict[str, Any] = {"GROUP": group, "PDL": pdl}
    if pdl:
        kw["launch_pdl"] = True
    if fixed is not None:
        bu = int(fixed.get("BLOCK_U", max(1, int(fixed.get("BLOCK_K", 128)) // 32)))
        kw.update(
            BLOCK_N=int(fixed.get("BLOCK_N", 16)),
            BLOCK_U=bu,
            SPLIT_K=min(int(fixed.get("SPLIT_K", 2)), -(-units // bu)),
            PREFETCH=int(fixed.get("PREFETCH", 0)),
        )
        if "num_warps" in fixed:
            kw["num_warps"] = fixed["num_warps"]
        fn = _kernel("int4_gemv_fixed")
    else:
        fn = _kernel("int4_gemv")

    def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], m)

    fn[grid](
        x2,
        words,
        scale,
        offset,
        bias if bias is not None else x2,
        y,
        ws,
        cnt,
        m,
        n,
        k,
        kw_total,
        x2.stride(0),
        words.stride(0),
        scale.stride(0),
        HAS_BIAS=bias is not None,
        **kw,
    )


#: `_int4_gemv`'s launches as measured where they run: in a CUDA graph of the layer's
#: Linears launched one after another (dependent launches where PDL is on), per GPU class,
#: shape, group, scale dtype and PDL; written by benchmarks/tune_int4.py --update-table.
#: Triton's autotuner times each launch alone, and its pick varies from process to
#: process. On an H100 (results/tune_int4_h100.json, 2026-12-06, the kernel with its
#: scales loaded before the wait) it was up to 1.33x slower than the measured best on a
#: shape, and the 154 Linears of the 1.1B Llama at one row took 0.445 ms with the table
#: against 0.502 autotuned (bf16 1.241: 2.79x against 2.47x). A shape the table lacks is
#: autotuned.
INT4_TILES_TABLE = Path(__file__).with_name("int4_tiles.json")


def _tile_key(device: str, n: int, k: int, group: int, sdtype: Any, pdl: bool) -> tuple:
    return (device, int(n), int(k), int(group), str(sdtype).removeprefix("torch."), bool(pdl))


def _entry_key(e: dict[str, Any]) -> tuple:
    return _tile_key(e["device"], e["n"], e["k"], e["group"], e["scale_dtype"], e["pdl"])


def int4_tiles(path: Path | None = None) -> dict[tuple, dict[str, Any]]:
    """The table's entries by (device class, N, K, group, scale dtype, PDL), read from the
    file (`int4_tile` keeps its answers, so launches do not come here)."""
    p = path or INT4_TILES_TABLE
    entries = read_entries(p, "INT4 launch table", WeightOnlyError)
    try:
        return {_entry_key(e): {**e["config"]} for e in entries}
    except (KeyError, TypeError, ValueError) as e:
        raise WeightOnlyError(
            f"the INT4 launch table {p} has an entry without its launch ({e}); restore it "
            "from the package."
        ) from None


def int4_tile(
    device: torch.device, n: int, k: int, group: int, sdtype: Any, pdl: bool
) -> dict[str, Any] | None:
    """The measured launch of `_int4_gemv` for this shape on this GPU, or None. Asked on
    every launch, so the answer is kept per table path and key (a decoding step calls
    each Linear once; reading the file's status each time would cost host time)."""
    if device.type != "cuda" or interpreting():
        return None
    memo_key = (INT4_TILES_TABLE, device.index, n, k, group, sdtype, pdl)
    if memo_key not in _INT4_MEMO:
        from opswap.kernels.crossover import device_class

        cfg = int4_tiles().get(_tile_key(device_class(device), n, k, group, sdtype, pdl))
        units = padded_k(k, group) // 32
        _INT4_MEMO[memo_key] = cfg if cfg is not None and _int4_fits(cfg, units) else None
    return _INT4_MEMO[memo_key]


_INT4_MEMO: dict[tuple, dict[str, Any] | None] = {}


def update_int4_tiles(rows: list[dict[str, Any]], source: str, path: Path | None = None) -> int:
    """Write tune_int4.py's winners ({device, n, k, group, scale_dtype, pdl, config, ...})
    into the table, replacing entries of the same key; returns how many were written."""
    fields = ("device", "n", "k", "group", "scale_dtype", "pdl", "config", "us",
              "speedup_vs_autotuned")  # fmt: skip
    merge_entries(
        path or INT4_TILES_TABLE,
        [{f: r[f] for f in fields if f in r} | {"source": source} for r in rows],
        _entry_key,
        "Measured launches of opswap's INT4 GEMV (kernels/weight_only.py INT4_TILES_TABLE), "
        "written by benchmarks/tune_int4.py --update-table.",
        "INT4 launch table",
        WeightOnlyError,
    )
    _INT4_MEMO.clear()
    return len(rows)


def tuned_config(kind: str) -> dict[str, Any]:
    """The autotuner's choice per (M, N, K) it has seen for one of KINDS:
    {"M,N,K": config} (for reports)."""
    fn = _KERNELS.get((kind, False))
    cache = getattr(fn, "cache", {}) if fn is not None else {}
    return {
        ",".join(str(v) for v in key[:3]): {**cfg.kwargs, "num_warps": cfg.num_warps}
        for key, cfg in cache.items()
    }


# ----------------------------------------------------------------------------- the op


def _dequant_linear(x, qweight, scale, offset, bias, bits, in_features) -> torch.Tensor:
    dtype = x.dtype if x.dtype.is_floating_point else torch.float32
    w = dequantize(qweight, scale, offset, bits, in_features, dtype)
    return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))


@torch.library.custom_op("opswap::wo_linear", mutates_args=())
def wo_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    in_features: int,
) -> torch.Tensor:
    """x [..., K] @ dequant(qweight)^T + bias, in x's dtype; see the module docstring."""
    return _dequant_linear(x, qweight, scale, offset, bias, bits, in_features)


@wo_linear.register_kernel("cpu")
def _cpu(x, qweight, scale, offset, bias, bits, in_features):
    # _weight_int8pack_mm crashed the process at K = 300 with 4 or more rows (torch 2.13);
    # every K that is a multiple of 8 tried ran: 272, 288, 296, 320, 640, 2048
    if (
        bits == 8
        and scale.shape[1] == 1
        and in_features % 16 == 0
        and x.dtype in (torch.float32, torch.bfloat16)
    ):
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, in_features).contiguous(), qweight, scale[:, 0].to(x.dtype)
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*lead, qweight.shape[0])
    return _dequant_linear(x, qweight, scale, offset, bias, bits, in_features)


@wo_linear.register_kernel("cuda")
def _cuda(x, qweight, scale, offset, bias, bits, in_features):
    rows = x.numel() // max(in_features, 1)
    if rows <= TRITON_MAX_ROWS and triton_supported(x) is None:
        return triton_wo_linear(x, qweight, scale, offset, bias, bits, in_features)
    return _dequant_linear(x, qweight, scale, offset, bias, bits, in_features)


@wo_linear.register_fake
def _fake(x, qweight, scale, offset, bias, bits, in_features):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))
