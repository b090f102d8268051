"""A tiled GEMM with a fused epilogue, as the op `opswap::gemm`:
`C = act(A @ B + bias) + residual`, A [..., K], B a Linear weight [N, K] (read through its
strides as [K, N], no copy) or a [K, N] matrix, C [..., N].

Tiling: each program computes one BLOCK_M x BLOCK_N tile of C, walking K in BLOCK_K
steps; per step it loads a BLOCK_M x BLOCK_K slab of A and a BLOCK_K x BLOCK_N slab of
B and accumulates their product in fp32 registers (tensor cores through `tl.dot`).
Per tile it reads (BLOCK_M + BLOCK_N) * K elements for 2 * BLOCK_M * BLOCK_N * K FLOPs,
so a 128 x 256 tile does 2 * 128 * 256 / (384 * 2 bytes) = 85 FLOP per byte of bf16
read from L2/HBM, past the H100's ridge (989 TFLOP/s over 3.35 TB/s: ~300 FLOP/B only
when counted from HBM; the grouped order below makes most of the reads L2 hits).
Grouped ordering: programs are numbered GROUP_M tiles down a column of tiles before
moving right, so the GROUP_M rows of A and the columns of B that consecutive programs
read stay in L2. `num_stages` pipelines the K loop (the loads of step k + s are in
flight while step k multiplies).

The epilogue runs on the fp32 accumulator before the one store: times the FP8 scales,
plus the bias, the activation (relu, gelu, gelu_tanh, silu), plus the residual. Eager
writes the GEMM's output, reads it back for the bias/activation and again for the
residual add: 3 more passes over M x N; here none, and one rounding to the output dtype
instead of three.

Precisions: bfloat16 / float16 inputs multiply on the tensor cores (fp32 accumulate);
float32 inputs either exactly ("ieee") or with TF32 tensor cores ("tf32": inputs rounded
to 10 mantissa bits, accumulate in fp32; Ampere and later); "fp8": float8_e4m3fn inputs
with per-tensor float32 scales, bfloat16 output, on Hopper (sm90) only.

Variants (`VARIANTS`, chosen per launch by `choose_launch`): "tiled", the kernel above,
autotuned; "persistent", one program per multiprocessor walking the tiles in the same
grouped order, its A and B slabs fetched by Hopper's TMA copy engine through host tensor
descriptors where the tensors allow (row-major, 16-byte aligned rows), else through
pointers; "splitk", for few rows and long K: K shared among programs that write fp32
partial sums to a workspace, then a second pass adds them in split order (deterministic,
no atomics) and runs the epilogue. All three share the grouped order, the K loop and the
epilogue (`gemm_tile`, `gemm_acc`, `gemm_epilogue`). The choice: a forced launch
(`forced_launch`, for benchmarks and tests), else the measured launch table
(gemm_launch.json, by device class, dtype, precision and shape class), else
`default_launch` (split-K for m <= 64 with K >= 1024 where the tiles fill under half the
GPU, persistent for 16-bit and FP8 inputs on sm90 with the TMA API, else tiled).

Where the Triton kernel does not run (a CPU without the interpreter, float64, an FP8
product off Hopper) the op computes `reference` in PyTorch: the same function in fp32
(float64 for float64), the TF32 product in float32 (a CPU has no TF32).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from opswap.kernels._rows import (
    KernelError,
    _hint,
    _is_fake,
    interpreting,
    jitted,
    rn,
    rn_flag,
    runs_triton,
    tl,
)
from opswap.kernels._rows import triton as _triton
from opswap.kernels._tables import merge_entries, read_entries
from opswap.kernels._triton_op import triton_op

#: the name the crossover table (kernels/crossover.py) measures this kernel under
CROSSOVER = ("gemm",)

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
PRECISIONS = ("ieee", "tf32", "fp8")
_ACT_ID = {a: i for i, a in enumerate(ACTIVATIONS)}
FP8 = torch.float8_e4m3fn
_HALF = (torch.float16, torch.bfloat16)
#: the (BLOCK_M, BLOCK_N, BLOCK_K) of the one configuration the interpreter runs
INTERPRET_BLOCKS = (16, 16, 16)


# ----------------------------------------------------------------------------- the reference


def activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    """act(y) in PyTorch, for the activation names the op takes."""
    if activation == "relu":
        return torch.relu(y)
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return F.silu(y)
    return y


def _weight_kn(b: torch.Tensor, b_transposed: bool) -> torch.Tensor:
    return b.t() if b_transposed else b  # [K, N]


def out_dtype(a: torch.Tensor, precision: str) -> torch.dtype:
    """The op's output dtype: bfloat16 for FP8 inputs, else a's."""
    return torch.bfloat16 if precision == "fp8" else a.dtype


def reference(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str = "none",
    b_transposed: bool = True,
    precision: str = "ieee",
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op's function in PyTorch, in fp32 (float64 for float64 inputs), rounded once to
    the output dtype. FP8 inputs are read as their e4m3 values times the scales; "tf32"
    computes the float32 product (what a CPU can do)."""
    check(a, b, bias, residual, activation, b_transposed, precision, scale_a, scale_b)
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    y = a.to(work) @ _weight_kn(b, b_transposed).to(work)
    if precision == "fp8":
        assert scale_a is not None and scale_b is not None  # check() demanded them
        y = y * (scale_a.to(work) * scale_b.to(work))
    if bias is not None:
        y = y + bias.to(work)
    y = activate(y, activation)
    if residual is not None:
        y = y + residual.to(work)
    return y.to(out_dtype(a, precision))


def check(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
    b_transposed: bool,
    precision: str,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> int:
    """N, after refusing in one sentence what the op cannot take."""
    if activation not in _ACT_ID:
        raise KernelError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}.")
    if precision not in PRECISIONS:
        raise KernelError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    if a.dim() < 1 or b.dim() != 2:
        raise KernelError(
            f"gemm takes a [..., K] input and a 2-D weight; got {list(a.shape)} and "
            f"{list(b.shape)}."
        )
    n, k = b.shape if b_transposed else (b.shape[1], b.shape[0])
    if a.shape[-1] != k:
        layout = "[N, K]" if b_transposed else "[K, N]"
        raise KernelError(
            f"the input's last dim is {a.shape[-1]} but the weight {list(b.shape)} read as "
            f"{layout} has K = {k}."
        )
    if precision == "fp8":
        if a.dtype != FP8 or b.dtype != FP8:
            raise KernelError(
                f"precision 'fp8' takes float8_e4m3fn input and weight; got {a.dtype} and {b.dtype}."
            )
        if scale_a is None or scale_b is None or scale_a.numel() != 1 or scale_b.numel() != 1:
            raise KernelError("precision 'fp8' needs scale_a and scale_b, one float each.")
    elif a.dtype != b.dtype or a.dtype not in (*_HALF, torch.float32, torch.float64):
        raise KernelError(
            f"gemm multiplies float32, float64, float16 or bfloat16 of one dtype; got "
            f"{a.dtype} and {b.dtype}."
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise KernelError(f"the bias is {list(bias.shape)}, and the output has N = {n} columns.")
    if residual is not None and tuple(residual.shape) != (*a.shape[:-1], n):
        raise KernelError(
            f"the residual is {list(residual.shape)}, and the output is "
            f"{[*a.shape[:-1], n]}; they must match."
        )
    return int(n)


# ----------------------------------------------------------------------------- the kernels

# The three variants share their pieces, each a `triton.jit` function named where it is
# defined (Inductor, compiling a graph that calls these kernels, copies each helper it
# finds under its def's name): the grouped tile order, the K loop and the epilogue.
if _triton is not None:

    @_triton.jit
    def gemm_tile(t, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        # tile t of the grouped order: GROUP_M tile rows share the B columns they read
        # while those are in L2, then the next GROUP_M rows
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + ((t % per_group) % group_m)
        pid_n = (t % per_group) // group_m
        return pid_m, pid_n

    @_triton.jit
    def gemm_dot(acc, a, b, TF32: tl.constexpr, F32: tl.constexpr, UPCAST: tl.constexpr):
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if TF32:
            acc = tl.dot(a, b, acc, input_precision="tf32")
        elif F32:  # float32 kept exact; 16-bit and FP8 tiles take the default
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @_triton.jit
    def gemm_acc(
        a_ptr,
        b_ptr,
        pid_m,
        pid_n,
        M,
        N,
        K,
        k_lo,  # a multiple of BLOCK_K
        k_hi,
        sam,
        sak,
        sbk,
        sbn,
        TF32: tl.constexpr,
        F32: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # the fp32 sum over k in [k_lo, k_hi) of the tile's A slab times its B slab, loaded
        # through pointers. Rows and columns past the edge wrap around (their results are
        # never stored), so the loads need no M/N mask. No max_contiguous hint: at the wrap
        # the indices restart at 0, and a vector load of a [K, N] weight's row would read
        # past column N
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        rn_ = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        rk = tl.arange(0, BLOCK_K)
        a_tile = a_ptr + rm[:, None].to(tl.int64) * sam + (k_lo + rk)[None, :] * sak
        b_tile = b_ptr + (k_lo + rk)[:, None] * sbk + rn_[None, :].to(tl.int64) * sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        left = K - k_lo
        for _i in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
            a = tl.load(a_tile, mask=rk[None, :] < left, other=0.0)
            b = tl.load(b_tile, mask=rk[:, None] < left, other=0.0)
            acc = gemm_dot(acc, a, b, TF32, F32, UPCAST)
            a_tile += BLOCK_K * sak
            b_tile += BLOCK_K * sbk
            left -= BLOCK_K
        return acc

    @_triton.jit
    def gemm_epilogue(
        acc,
        c_ptr,  # [M, N] contiguous
        bias_ptr,
        res_ptr,
        sa_ptr,
        sb_ptr,
        pid_m,
        pid_n,
        M,
        N,
        srm,
        srn,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        SCALED: tl.constexpr,
        ACT: tl.constexpr,  # 0 none, 1 relu, 2 gelu (erf), 3 gelu (tanh), 4 silu
        RN: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # on the fp32 accumulator: the FP8 scales, the bias, the activation, the
        # residual; then the one rounding to the output dtype and the store
        cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (cm[:, None] < M) & (cn[None, :] < N)
        if SCALED:
            acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cn, mask=cn < N, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:
            acc = tl.maximum(acc, 0.0)
        elif ACT == 2:
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        elif ACT == 3:
            z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = acc * tl.sigmoid(2.0 * z)  # 0.5 (1 + tanh z) = sigmoid(2 z)
        elif ACT == 4:
            acc = acc * tl.sigmoid(acc)
        if HAS_RES:
            r_ptrs = res_ptr + cm[:, None].to(tl.int64) * srm + cn[None, :] * srn
            acc += tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32)
        c_ptrs = c_ptr + cm[:, None].to(tl.int64) * N + cn[None, :]
        tl.store(c_ptrs, rn(acc, RN).to(c_ptr.dtype.element_ty), mask=ok)

else:  # pragma: no cover
    gemm_tile = gemm_dot = gemm_acc = gemm_epilogue = None


def _gemm_fn(
    a_ptr,  # [M, K], strides (sam, sak): row-major or a transposed view
    b_ptr,  # [K, N] as addressed, strides (sbk, sbn): a Linear weight [N, K] has sbk = 1
    c_ptr,  # [M, N] contiguous
    bias_ptr,  # [N] or a dummy
    res_ptr,  # [M, N], strides (srm, srn), or a dummy
    sa_ptr,  # FP8 scales (one float each) or dummies
    sb_ptr,
    M,
    N,
    K,
    M_BUCKET,  # the autotuner's key only
    sam,
    sak,
    sbk,
    sbn,
    srm,
    srn,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    SCALED: tl.constexpr,
    ACT: tl.constexpr,
    TF32: tl.constexpr,
    F32: tl.constexpr,  # float32 tiles (or bf16 ones upcast in the interpreter)
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
    UPCAST: tl.constexpr,  # the interpreter's bf16 product: in fp32 (exact: bf16 fits)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # "tiled": one program per output tile, the programs in grouped order
    pid_m, pid_n = gemm_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = gemm_acc(a_ptr, b_ptr, pid_m, pid_n, M, N, K, 0, K, sam, sak, sbk, sbn,
                   TF32, F32, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    gemm_epilogue(acc, c_ptr, bias_ptr, res_ptr, sa_ptr, sb_ptr, pid_m, pid_n, M, N, srm, srn,
                  HAS_BIAS, HAS_RES, SCALED, ACT, RN, BLOCK_M, BLOCK_N)  # fmt: skip


def _persistent_fn(
    a_ptr,  # with TMA a descriptor of A [M, K] (row-major), else as in _gemm_fn
    b_ptr,  # with TMA a descriptor of B [N, K] (B_KN: [K, N]), else as in _gemm_fn
    c_ptr,
    bias_ptr,
    res_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    srm,
    srn,
    programs,  # the grid: one program per multiprocessor on a GPU
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    SCALED: tl.constexpr,
    ACT: tl.constexpr,
    TF32: tl.constexpr,
    F32: tl.constexpr,
    RN: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    B_KN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,  # let the pipeliner run the tile loop and the K loop as one
):
    # "persistent": program p computes tiles p, p + programs, ... in the grouped order,
    # so consecutive programs work on neighbouring tiles at every step of the loop
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for t in tl.range(tl.program_id(0), tiles, programs, flatten=FLATTEN):
        pid_m, pid_n = gemm_tile(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        if TMA:
            # the copy engine fetches whole boxes into shared memory; rows, columns and K
            # steps past the tensor's edge arrive as zeros, so no masks
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                a = a_ptr.load([pid_m * BLOCK_M, k])
                if B_KN:
                    b = b_ptr.load([k, pid_n * BLOCK_N])
                else:
                    b = b_ptr.load([pid_n * BLOCK_N, k]).T
                acc = gemm_dot(acc, a, b, TF32, F32, UPCAST)
        else:
            acc = gemm_acc(a_ptr, b_ptr, pid_m, pid_n, M, N, K, 0, K, sam, sak, sbk, sbn,
                           TF32, F32, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        gemm_epilogue(acc, c_ptr, bias_ptr, res_ptr, sa_ptr, sb_ptr, pid_m, pid_n, M, N,
                      srm, srn, HAS_BIAS, HAS_RES, SCALED, ACT, RN, BLOCK_M, BLOCK_N)  # fmt: skip


def _splitk_fn(
    a_ptr,  # as in _gemm_fn
    b_ptr,
    ws_ptr,  # [SPLIT, M, N] fp32 partial sums
    M,
    N,
    K,
    k_per,  # K elements per split, a multiple of BLOCK_K
    sws,  # M * N: one split's partial sums
    sam,
    sak,
    sbk,
    sbn,
    TF32: tl.constexpr,
    F32: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # "splitk", pass 1: program (t, s) sums tile t's products over the s-th share of K
    # and writes them, unrounded, to the workspace's s-th [M, N] plane
    pid_m, pid_n = gemm_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo = tl.program_id(1) * k_per
    k_hi = min(k_lo + k_per, K)
    acc = gemm_acc(a_ptr, b_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, sam, sak, sbk, sbn,
                   TF32, F32, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w = ws_ptr + tl.program_id(1).to(tl.int64) * sws
    ok = (cm[:, None] < M) & (cn[None, :] < N)
    tl.store(w + cm[:, None].to(tl.int64) * N + cn[None, :], acc, mask=ok)


def _splitk_sum_fn(
    ws_ptr,  # [SPLIT, M, N] fp32
    c_ptr,
    bias_ptr,
    res_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N,
    SPLIT,
    sws,
    srm,
    srn,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    SCALED: tl.constexpr,
    ACT: tl.constexpr,
    RN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # "splitk", pass 2: the splits' partial sums added in split order (the same order on
    # every run: the result is deterministic), then the epilogue
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (cm[:, None] < M) & (cn[None, :] < N)
    w = ws_ptr + cm[:, None].to(tl.int64) * N + cn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SPLIT):  # noqa: B007 - the order is the point, not s
        acc += tl.load(w, mask=ok, other=0.0)
        w += sws
    gemm_epilogue(acc, c_ptr, bias_ptr, res_ptr, sa_ptr, sb_ptr, pid_m, pid_n, M, N, srm, srn,
                  HAS_BIAS, HAS_RES, SCALED, ACT, RN, BLOCK_M, BLOCK_N)  # fmt: skip


def _config(bm: int, bn: int, bk: int, group: int, stages: int, warps: int) -> Any:
    return _triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
        num_stages=stages,
        num_warps=warps,
    )


def configs() -> list[Any]:
    """The autotuner's configurations, by the class of GEMM each is for (`_prune` keeps
    those of a launch's class): large tiles for square and prefill GEMMs (128 x 256 x 64,
    3 stages, 8 warps is what Triton's matmul tutorials run on sm90 at 4096^3), short
    and wide ones with long K steps for decode's few rows (memory-bound: a weight row
    read once per program), smaller K steps for 4-byte float32 and longer for 1-byte FP8
    (shared memory per stage is (BLOCK_M + BLOCK_N) * BLOCK_K * bytes)."""
    return [
        # (bm, bn, bk, group, stages, warps)
        *[
            _config(*c)
            for c in (
                (128, 256, 64, 8, 3, 8),
                (256, 128, 64, 8, 3, 8),
                (128, 128, 64, 8, 4, 4),
                (128, 128, 64, 8, 3, 8),
                (128, 64, 64, 8, 4, 4),
                (64, 128, 64, 8, 4, 4),
                (64, 64, 64, 8, 4, 4),
                # 1-byte FP8 tiles take twice the K step in the same shared memory
                (128, 256, 128, 8, 3, 8),
                (128, 128, 128, 8, 4, 8),
            )
        ],
        *[
            _config(*c)
            for c in (
                (16, 64, 128, 1, 4, 4),
                (16, 128, 128, 1, 4, 4),
                (16, 32, 256, 1, 3, 4),
                (32, 64, 128, 1, 4, 4),
                (64, 64, 128, 1, 3, 4),
            )
        ],
    ]


def configs_for(m: int, size: int) -> list[Any]:
    """The configurations of `configs()` a launch of m rows and `size`-byte inputs tries:
    decode tiles (BLOCK_M <= 32) for m <= 32, prefill tiles otherwise, and none whose
    stages need more shared memory than an sm90 multiprocessor has (200 KiB kept)."""
    keep = [
        c
        for c in configs()
        if (c.kwargs["BLOCK_M"] <= 32) == (m <= 32)
        and (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * size * c.num_stages
        <= 200 * 1024
    ]
    return keep or [_config(64, 64, 32, 8, 3, 4)]


_KERNELS: dict[tuple[bool, bool, int], Any] = {}


def _kernel(m: int, size: int) -> Any:
    """The kernel for m rows of `size`-byte inputs: on a GPU autotuned over
    `configs_for(m, size)`, keyed on the row count's bucket, N, K and the dtypes (one
    autotuner per row class and input size, pruned here rather than by the autotuner's
    prune hook, which Inductor's support of user kernels does not promise); in the
    interpreter plain, the caller passing INTERPRET_BLOCKS."""
    key = (interpreting(), m <= 32, size)
    if key not in _KERNELS:
        if key[0]:
            _KERNELS[key] = jitted(_gemm_fn)
        else:
            _KERNELS[key] = _triton.autotune(configs_for(m, size), key=["M_BUCKET", "N", "K"])(
                _jit()
            )
    return _KERNELS[key]


_JIT: list[Any] = []


def _jit() -> Any:
    """The one compiled-mode JITFunction of the kernel, shared by the autotuners."""
    if not _JIT:
        _JIT.append(_triton.jit(_gemm_fn))
    return _JIT[0]


def m_bucket(m: int) -> int:
    """The row count's autotuning bucket: the next power of two (decode's 1..16 apart,
    prefill's thousands in a few classes)."""
    return 1 << max(0, m - 1).bit_length()


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def shape_class(m: int, n: int, k: int) -> str:
    """The crossover table's class of an M x K by K x N GEMM: each size's power-of-two
    bucket ("m<=16,n<=16384,k<=4096")."""
    return f"m<={_pow2(m)},n<={_pow2(n)},k<={_pow2(k)}"


def fp8_ready(device: torch.device) -> bool:
    """Whether the FP8 product runs on `device` (Hopper, sm90)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _kernel_takes(a: torch.Tensor, precision: str) -> bool:
    if not runs_triton(a) or a.dtype == torch.float64:
        return False
    if precision == "fp8":
        return a.device.type == "cuda" and fp8_ready(a.device)
    return True


# ----------------------------------------------------------------------------- the variants

#: "tiled": `_gemm_fn`, one program per output tile, autotuned over `configs_for`;
#: "persistent": `_persistent_fn`, one program per multiprocessor looping over the tiles,
#: its A and B tiles fetched by the TMA copy engine on Hopper; "splitk": `_splitk_fn` then
#: `_splitk_sum_fn`, K shared among programs, for few rows and long K
VARIANTS = ("tiled", "persistent", "splitk")
#: the largest split of K the shape-derived split count takes
MAX_SPLIT_K = 16
#: the measured choice of variant and configuration per shape class, written by
#: `benchmarks/bench_gemm.py --update-crossover`
LAUNCH_TABLE = Path(__file__).with_name("gemm_launch.json")


@dataclass(frozen=True)
class Launch:
    """How one GEMM is launched: the variant and its configuration. block_m = 0 leaves a
    "tiled" launch to the autotuner; split_k = 0 takes the split from the shape
    (`split_count`), programs = 0 the multiprocessor count; tma=False has the persistent
    kernel load through pointers where it could use the copy engine."""

    variant: str = "tiled"
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    group_m: int = 8
    stages: int = 3
    warps: int = 4
    split_k: int = 0
    programs: int = 0
    flatten: bool = True
    tma: bool = True

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise KernelError(f"variant {self.variant!r} is not one of {', '.join(VARIANTS)}.")
        blocks = (self.block_m, self.block_n, self.block_k)
        if self.block_m == 0 and self.variant == "tiled":
            return
        if any(b < 16 or b & (b - 1) for b in blocks):
            raise KernelError(
                f"the {self.variant} GEMM's blocks {list(blocks)} must be powers of two of at "
                "least 16."
            )
        if min(self.group_m, self.stages, self.warps) < 1 or min(self.split_k, self.programs) < 0:
            raise KernelError(
                "group_m, stages and warps must be positive, split_k and programs not negative."
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Launch:
        return cls(**{f: d[f] for f in cls.__dataclass_fields__ if f in d})


_FORCED: list[Launch] = []
#: what the last Triton GEMM launched: {"variant", "tma" (the persistent kernel read
#: through TMA descriptors), "splits"} (for the tests and the benchmark's rows)
LAST_RUN: dict[str, Any] = {}


@contextlib.contextmanager
def forced_launch(launch: Launch) -> Iterator[None]:
    """Within the block every opswap::gemm that runs the Triton kernel launches `launch`
    (the benchmark times each variant this way; the tests run each one)."""
    _FORCED.append(launch)
    try:
        yield
    finally:
        _FORCED.pop()


@functools.cache
def tma_api() -> bool:
    """Whether this Triton has host-side tensor descriptors that a kernel loads from
    (`triton.tools.tensor_descriptor.TensorDescriptor`, `desc.load`: Triton 3.4 on)."""
    if _triton is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def tma_ready(device: torch.device) -> bool:
    """Whether the persistent variant is a default on `device`: a Hopper GPU (capability
    9.0) and a Triton with the TMA API."""
    return device.type == "cuda" and _capability(device.index) == (9, 0) and tma_api()


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def _tma_layout(t: torch.Tensor) -> bool:
    """Whether the copy engine can read `t` as a 2-D tensor: row-major, rows 16-byte
    aligned, the start 16-byte aligned (a fake tensor, while torch.compile traces, has no
    address and is refused)."""
    size = t.element_size()
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * size) % 16 == 0
        and not _is_fake(t)
        and t.data_ptr() % 16 == 0
    )


def default_launch(m: int, n: int, k: int, size: int, hopper_tma: bool, sms: int) -> Launch:
    """The launch without a measured table entry, for an m x k by k x n GEMM of `size`-byte
    inputs on a GPU of `sms` multiprocessors (`hopper_tma`: Hopper with the TMA API).

    Few rows (m <= 64) and K of at least 1024 whose tiles fill under half the GPU: split-K,
    16 to 64 rows by 64 columns by 128 K (64 for float32) per program, 4 stages, 4 warps
    (a memory-bound program streams its weight slice; more splits put more loads in
    flight). Otherwise on Hopper, for 2-byte and 1-byte (FP8) inputs: persistent with TMA,
    128 x 256 x 64, 3 stages, 8 warps where those tiles make at least one per
    multiprocessor, else 128 x 128 x 64, 4 stages, 8 warps (the bf16 starting points of
    Triton's persistent matmul tutorial and of Inductor's persistent TMA template for
    sm90; K steps of 128 for FP8, the same bytes a stage). Elsewhere, float32 included
    (its exact product runs on the CUDA cores, where the autotuner's smaller tiles were
    measured): "tiled", autotuned."""
    if m <= 64 and k >= 1024:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bk = 64 if size >= 4 else 128
        tiles = -(-m // bm) * -(-n // 64)
        if 2 * tiles <= sms:
            return Launch("splitk", bm, 64, bk, 1, 4, 4)
    if hopper_tma and m > 64 and size <= 2:
        bk = 128 if size == 1 else 64
        if -(-m // 128) * -(-n // 256) >= sms:
            return Launch("persistent", 128, 256, bk, 8, 3, 8)
        return Launch("persistent", 128, 128, bk, 8, 4, 8)
    return Launch()


def split_count(m: int, n: int, k: int, launch: Launch, sms: int) -> tuple[int, int]:
    """(splits, K elements per split) of a split-K launch: launch.split_k, or the
    multiprocessors over the output tiles (at least 1, at most MAX_SPLIT_K and the K steps);
    each split a whole number of K steps, and none empty."""
    steps = -(-k // launch.block_k)
    tiles = -(-m // launch.block_m) * -(-n // launch.block_n)
    want = launch.split_k or max(1, min(MAX_SPLIT_K, sms // max(1, tiles)))
    per = -(-steps // max(1, min(want, steps)))
    return -(-steps // per), per * launch.block_k


def _table_key(device: str, dtype: str, precision: str, shape: str) -> tuple[str, str, str, str]:
    return (device, dtype.removeprefix("torch."), precision, shape)


def _entry_key(e: dict[str, Any]) -> tuple[str, str, str, str]:
    return _table_key(e["device"], e["dtype"], e["precision"], e["shape"])


def launch_table(path: Path | None = None) -> dict[tuple[str, str, str, str], Launch]:
    """The table's launches by (device class, dtype, precision, shape class)."""
    p = path or LAUNCH_TABLE
    entries = read_entries(p, "GEMM launch table", KernelError)
    try:
        return {_entry_key(e): Launch.from_json(e["launch"]) for e in entries}
    except (KeyError, TypeError) as e:
        raise KernelError(
            f"the GEMM launch table {p} has an entry without its launch ({e}); restore it "
            "from the package."
        ) from None


_TABLE_MEMO: dict[tuple[Any, ...], Launch | None] = {}


def table_launch(
    device: torch.device, dtype: torch.dtype, precision: str, m: int, n: int, k: int
) -> Launch | None:
    """The measured launch for this shape class on this GPU, or None (kept per key: every
    launch asks)."""
    shape = shape_class(m, n, k)
    key = (LAUNCH_TABLE, device.index, dtype, precision, shape)
    if key not in _TABLE_MEMO:
        from opswap.kernels.crossover import device_class

        _TABLE_MEMO[key] = launch_table().get(
            _table_key(device_class(device), str(dtype), precision, shape)
        )
    return _TABLE_MEMO[key]


def update_launch_table(rows: list[dict[str, Any]], source: str, path: Path | None = None) -> int:
    """Write measured launches ({device, dtype, precision, shape, launch, ...}) into the
    table, replacing those of the same key; returns how many were written."""
    fields = ("device", "dtype", "precision", "shape", "launch", "ms", "cublas_ms")
    merge_entries(
        path or LAUNCH_TABLE,
        [{f: r[f] for f in fields if f in r} | {"source": source} for r in rows],
        _entry_key,
        "Measured launches of opswap::gemm (kernels/gemm.py LAUNCH_TABLE): the fastest "
        "variant and configuration per shape class, written by benchmarks/bench_gemm.py "
        "--update-crossover.",
        "GEMM launch table",
        KernelError,
    )
    _TABLE_MEMO.clear()
    return len(rows)


def _sms(device: torch.device) -> int:
    """The multiprocessors of `device` (4 in the interpreter), asked once per GPU."""
    return _cuda_sms(device.index) if device.type == "cuda" else 4


@functools.cache
def _cuda_sms(index: int | None) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def choose_launch(
    a2: torch.Tensor, b: torch.Tensor, b_transposed: bool, precision: str, n: int
) -> Launch:
    """The launch of a Triton GEMM of a2 [M, K]: a forced one (`forced_launch`), else the
    table's for the shape class on this GPU, else `default_launch`; in the interpreter
    "tiled" unless forced. While torch.compile or torch.export traces the op, a persistent
    choice becomes "tiled": their tracing of a Triton kernel takes no host TMA
    descriptors."""
    m, k, n = _plain(a2.shape[0]), _plain(a2.shape[1]), _plain(n)
    if _FORCED:
        launch = _FORCED[-1]
    elif interpreting():
        launch = Launch()
    else:
        launch = table_launch(a2.device, a2.dtype, precision, m, n, k) or default_launch(
            m, n, k, a2.element_size(), tma_ready(a2.device), _sms(a2.device)
        )
    if launch.variant == "persistent" and _is_fake(a2):
        return Launch()
    return launch


def _plain(v: Any) -> int:
    """A size as an int without a guard: while torch.compile traces with dynamic shapes,
    its hint (the launch is a choice of speed; every launch is right at every size)."""
    h = _hint(v)
    return h if h is not None else 1


def _descriptors(
    a2: torch.Tensor, b: torch.Tensor, b_transposed: bool, launch: Launch
) -> tuple[Any, Any] | None:
    """Host TMA descriptors of A [M, K] and B (a Linear weight [N, K] or a [K, N] matrix)
    with the launch's block boxes, or None where the tensors' layout does not allow them."""
    hopper = a2.device.type != "cuda" or _capability(a2.device.index) >= (9, 0)
    if not (launch.tma and hopper and tma_api() and _tma_layout(a2) and _tma_layout(b)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = launch.block_m, launch.block_n, launch.block_k
    return (
        TensorDescriptor.from_tensor(a2, [bm, bk]),
        TensorDescriptor.from_tensor(b, [bn, bk] if b_transposed else [bk, bn]),
    )


def triton_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
    b_transposed: bool,
    precision: str,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
) -> torch.Tensor:
    n = check(a, b, bias, residual, activation, b_transposed, precision, scale_a, scale_b)
    lead, k = a.shape[:-1], a.shape[-1]
    a2 = a if a.dim() == 2 else a.reshape(-1, k)  # a transposed 2-D view stays a view
    m = a2.shape[0]
    dtype = out_dtype(a, precision)
    c = torch.empty((m, n), device=a.device, dtype=dtype)
    if m == 0 or n == 0:
        return c.reshape(*lead, n)
    if k == 0:
        return reference(
            a, b, bias, residual, activation, b_transposed, precision, scale_a, scale_b
        )
    bkn = _weight_kn(b, b_transposed)
    r2 = residual.reshape(m, n) if residual is not None else c
    dummy = c
    epilogue = (
        bias if bias is not None else dummy,
        r2,
        scale_a if scale_a is not None else dummy,
        scale_b if scale_b is not None else dummy,
    )
    flags: dict[str, Any] = dict(
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        SCALED=precision == "fp8",
        ACT=_ACT_ID[activation],
        RN=rn_flag(dtype),
    )
    dot: dict[str, Any] = dict(
        TF32=precision == "tf32",
        F32=a.dtype == torch.float32 or (interpreting() and a.dtype == torch.bfloat16),
        # Triton 3.9's interpreter multiplies bf16 tiles wrongly (2e10 off on 16 x 16 randn);
        # bf16 values are exact in fp32, so the fp32 product is the same math
        UPCAST=interpreting() and a.dtype == torch.bfloat16,
    )
    strides = (a2.stride(0), a2.stride(1), bkn.stride(0), bkn.stride(1))
    launch = choose_launch(a2, b, b_transposed, precision, n)
    LAST_RUN.update(variant=launch.variant, tma=False, splits=1)
    if launch.variant == "splitk":
        _run_splitk(a2, bkn, c, epilogue, m, n, k, strides, r2, launch, flags, dot)
    elif launch.variant == "persistent":
        # FP8 tensor cores read B K-major: a [K, N] FP8 weight goes through pointers
        fp8_kn = precision == "fp8" and not b_transposed
        descs = None if fp8_kn else _descriptors(a2, b, b_transposed, launch)
        LAST_RUN["tma"] = descs is not None
        bm, bn = launch.block_m, launch.block_n
        tiles = _triton.cdiv(m, bm) * _triton.cdiv(n, bn)
        programs = launch.programs or min(tiles, _sms(a.device))
        wrap_triton(jitted(_persistent_fn))[(programs,)](
            *(descs or (a2, bkn)),
            c,
            *epilogue,
            m,
            n,
            k,
            *strides,
            r2.stride(0),
            r2.stride(1),
            programs,
            **flags,
            **dot,
            TMA=descs is not None,
            B_KN=not b_transposed,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=launch.block_k,
            GROUP_M=launch.group_m,
            FLATTEN=launch.flatten,
            **_compiled(launch),
        )
    else:
        _run_tiled(a2, bkn, c, epilogue, m, n, k, strides, r2, launch, flags, dot)
    return c.reshape(*lead, n)


def _compiled(launch: Launch) -> dict[str, int]:
    """The launch's warps and stages (the interpreter takes neither)."""
    return {} if interpreting() else dict(num_warps=launch.warps, num_stages=launch.stages)


def _run_tiled(
    a2: torch.Tensor,
    bkn: torch.Tensor,
    c: torch.Tensor,
    epilogue: tuple[torch.Tensor, ...],
    m: int,
    n: int,
    k: int,
    strides: tuple[int, ...],
    r2: torch.Tensor,
    launch: Launch,
    flags: dict[str, Any],
    dot: dict[str, Any],
) -> None:
    """Today's kernel: autotuned on a GPU (block_m = 0), else the launch's blocks (the
    interpreter's INTERPRET_BLOCKS when it names none)."""
    meta = {**flags, **dot}
    if launch.block_m:
        fn = jitted(_gemm_fn)
        meta.update(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k)
        meta.update(GROUP_M=launch.group_m, **_compiled(launch))
    elif interpreting():
        fn = _kernel(m, a2.element_size())
        bm, bn, bk = INTERPRET_BLOCKS
        meta.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)
    else:
        fn = _kernel(m, a2.element_size())

    def grid(meta_: dict[str, Any]) -> tuple[int]:
        return (_triton.cdiv(m, meta_["BLOCK_M"]) * _triton.cdiv(n, meta_["BLOCK_N"]),)

    wrap_triton(fn)[grid](
        a2, bkn, c, *epilogue, m, n, k, m_bucket(m), *strides, r2.stride(0), r2.stride(1), **meta
    )


def _run_splitk(
    a2: torch.Tensor,
    bkn: torch.Tensor,
    c: torch.Tensor,
    epilogue: tuple[torch.Tensor, ...],
    m: int,
    n: int,
    k: int,
    strides: tuple[int, ...],
    r2: torch.Tensor,
    launch: Launch,
    flags: dict[str, Any],
    dot: dict[str, Any],
) -> None:
    """Split-K: partial sums of each share of K into an fp32 workspace [splits, M, N],
    then one pass that adds them in split order and applies the epilogue (two launches,
    no atomics: the same bits on every run)."""
    splits, per = split_count(_plain(m), _plain(n), _plain(k), launch, _sms(a2.device))
    LAST_RUN["splits"] = splits
    bm, bn = launch.block_m, launch.block_n
    ws = torch.empty((splits, m, n), device=a2.device, dtype=torch.float32)
    tiles = _triton.cdiv(m, bm) * _triton.cdiv(n, bn)
    wrap_triton(jitted(_splitk_fn))[(tiles, splits)](
        a2, bkn, ws, m, n, k, per, m * n, *strides, **dot, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=launch.block_k, GROUP_M=launch.group_m, **_compiled(launch),
    )  # fmt: skip
    sm, sn = (16, 16) if interpreting() else (max(16, min(64, _pow2(m))), 128)
    wrap_triton(jitted(_splitk_sum_fn))[(_triton.cdiv(m, sm), _triton.cdiv(n, sn))](
        ws, c, *epilogue, m, n, splits, m * n, r2.stride(0), r2.stride(1), **flags,
        BLOCK_M=sm, BLOCK_N=sn, **({} if interpreting() else dict(num_warps=4)),
    )  # fmt: skip


# ----------------------------------------------------------------------------- the op


@triton_op("opswap::gemm", mutates_args=())
def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
    b_transposed: bool,
    precision: str,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(a @ B + bias) + residual, B = b.T (a Linear weight [N, K]) when b_transposed,
    else b [K, N]; a [..., K] -> [..., N]. precision: "ieee" (bf16/fp16 on tensor cores,
    float32 exact), "tf32" (float32 on TF32 tensor cores) or "fp8" (e4m3 inputs with
    scale_a and scale_b, bfloat16 out, Hopper)."""
    if _kernel_takes(a, precision):
        return triton_gemm(
            a, b, bias, residual, activation, b_transposed, precision, scale_a, scale_b
        )
    out = reference(a, b, bias, residual, activation, b_transposed, precision, scale_a, scale_b)
    return out.contiguous()


@gemm.register_fake
def _fake(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
    b_transposed: bool,
    precision: str,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    n = b.shape[0] if b_transposed else b.shape[1]
    return a.new_empty((*a.shape[:-1], n), dtype=out_dtype(a, precision))


# ----------------------------------------------------------------------------- autograd


def _act_grad(z: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(z) / dz, elementwise."""
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        return 0.5 * (1 + torch.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * torch.exp(
            -0.5 * z * z
        )
    if activation == "gelu_tanh":
        t = torch.tanh(0.7978845608028654 * (z + 0.044715 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * 0.7978845608028654 * (1 + 0.134145 * z * z)
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    return torch.ones_like(z)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, b, bias, residual, activation, b_transposed, precision = inputs[:7]
    ctx.save_for_backward(a, b, bias)
    ctx.activation, ctx.b_transposed, ctx.precision = activation, b_transposed, precision
    ctx.has_res = residual is not None


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # PyTorch ops: recompute the pre-activation z in fp32, then the three products
    a, b, bias = ctx.saved_tensors
    if ctx.precision == "fp8":
        raise KernelError("the FP8 gemm has no backward; train in bfloat16 and convert after.")
    k = a.shape[-1]
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    a2, bkn = a.reshape(-1, k).to(work), _weight_kn(b, ctx.b_transposed).to(work)
    dy2 = dy.reshape(a2.shape[0], -1).to(work)
    dz = dy2
    if ctx.activation != "none":
        z = a2 @ bkn + (bias.to(work) if bias is not None else 0)
        dz = dy2 * _act_grad(z, ctx.activation)
    da = (dz @ bkn.t()).reshape(a.shape).to(a.dtype)
    dbkn = a2.t() @ dz
    db = (dbkn.t() if ctx.b_transposed else dbkn).to(b.dtype)
    dbias = dz.sum(0).to(bias.dtype) if bias is not None else None
    dres = dy if ctx.has_res else None
    return da, db, dbias, dres, None, None, None, None, None


gemm.register_autograd(_backward, setup_context=_setup)
