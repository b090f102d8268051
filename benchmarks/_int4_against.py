"""The INT4 GEMV kernel as it stood at commit a242f34 (scales loaded after the PDL wait),
extracted for tune_int4.py --against: not part of the package."""
# ruff: noqa
from typing import Any

import triton
import triton.language as tl

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
#
# The compiled loop at BLOCK_N 16, BLOCK_U 64, 4 warps (a 2048-wide row in one chunk, 256
# codes a thread): 840 instructions with Triton 3.6 (864 with 3.9), 3.3 a code: 256 LOP3,
# 240 FFMA + 16 FMUL for the codes, 10 LDG.E.128, no I2F, 168 registers (3 programs an SM).
# Issue then allows 39 codes a clock (5.7 TB/s-equivalent), so the bytes, not the
# instructions, should set the time. Split-K, the workspace and the counters are
# `_wo_kernel`'s.

#: 2^D: the INT4 GEMV's partial sums are kept at 2^-D times their value
_INT4_D = tl.constexpr(64) if tl is not None else 64


def _int4_chunk_fn(
    acc,
    w,
    c,
    x_row,
    s_cols,
    o_cols,
    K,
    KW,
    xf,
    BLOCK_N: tl.constexpr,
    BLOCK_U: tl.constexpr,
    GROUP: tl.constexpr,
):
    # one chunk of `_int4_gemv`: w [BLOCK_N, 4 BLOCK_U] int32 words, already loaded
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
    g = ((c * BLOCK_U + tl.arange(0, BLOCK_U)) * 32) // GROUP
    gm = (g < (KW * 8) // GROUP)[None, :]
    # loaded as [BLOCK_U, BLOCK_N] and transposed: Triton 3.6 then lays s out as acc is
    # (lanes along the units); a [BLOCK_N, BLOCK_U] load put its lanes along the rows
    # and cost a shared-memory exchange of acc every chunk (912 instructions, not 840)
    s = tl.trans(tl.load(s_cols + g[:, None], mask=gm.T, other=0.0).to(tl.float32))
    m = tl.trans(tl.load(o_cols + g[:, None], mask=gm.T, other=0.0).to(tl.float32))
    acc += m * (xu * (2.0**-_INT4_D))[None, :]
    acc += s * tl.sum(p, 2)
    return acc


# a helper the kernel calls is jitted where it is defined, under the name the kernel calls
# (as `_rows.rn`): the interpreter and the compiler both resolve it by that global
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
    rw = tl.arange(0, 4 * BLOCK_U)
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
    # the first chunk's weights are loaded before anything an earlier kernel writes is
    # read: under PDL that load overlaps the end of the kernel before (the weights are
    # never written by it); x, the only input a previous kernel makes, is read after
    j = c0 * (4 * BLOCK_U) + rw  # words
    kw_end = tl.where(c0 < c1, KW, 0)  # a program with no chunk (split-K's last) loads none
    w = tl.load(w_rows + j[None, :], mask=(j < kw_end)[None, :], other=0)
    # PREFETCH chunks ahead (0, 1 or 2): the next chunks' words are in flight while this
    # one is computed (PREFETCH + 1 chunks of weights in registers), and under PDL the
    # first PREFETCH + 1 are loaded before the wait. A chunk past the program's share
    # loads nothing (its mask is empty).
    if PREFETCH >= 1:
        j = j + 4 * BLOCK_U
        w1 = tl.load(w_rows + j[None, :], mask=(j < tl.where(c0 + 1 < c1, KW, 0))[None, :], other=0)
    if PREFETCH >= 2:
        j = j + 4 * BLOCK_U
        w2 = tl.load(w_rows + j[None, :], mask=(j < tl.where(c0 + 2 < c1, KW, 0))[None, :], other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = _int4_chunk(acc, w, c0, x_row, s_cols, o_cols, K, KW, xf, BLOCK_N, BLOCK_U, GROUP)
    for c in range(c0 + 1, c1):
        if PREFETCH >= 2:
            w = w1
            w1 = w2
            j = (c + 2) * (4 * BLOCK_U) + rw
            w2 = tl.load(
                w_rows + j[None, :], mask=(j < tl.where(c + 2 < c1, KW, 0))[None, :], other=0
            )
        elif PREFETCH == 1:
            w = w1
            j = (c + 1) * (4 * BLOCK_U) + rw
            w1 = tl.load(
                w_rows + j[None, :], mask=(j < tl.where(c + 1 < c1, KW, 0))[None, :], other=0
            )
        else:
            j = c * (4 * BLOCK_U) + rw
            w = tl.load(w_rows + j[None, :], mask=(j < KW)[None, :], other=0)
        acc = _int4_chunk(acc, w, c, x_row, s_cols, o_cols, K, KW, xf, BLOCK_N, BLOCK_U, GROUP)
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


