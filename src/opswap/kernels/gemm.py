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

Where the Triton kernel does not run (a CPU without the interpreter, float64, an FP8
product off Hopper) the op computes `reference` in PyTorch: the same function in fp32
(float64 for float64), the TF32 product in float32 (a CPU has no TF32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from opswap.kernels._rows import KernelError, interpreting, jitted, rn, rn_flag, runs_triton, tl
from opswap.kernels._rows import triton as _triton
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


# ----------------------------------------------------------------------------- the kernel


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
    ACT: tl.constexpr,  # 0 none, 1 relu, 2 gelu (erf), 3 gelu (tanh), 4 silu
    TF32: tl.constexpr,
    F32: tl.constexpr,  # float32 tiles (or bf16 ones upcast in the interpreter)
    RN: tl.constexpr,  # the interpreter's bf16 rounding (kernels/_rows.py)
    UPCAST: tl.constexpr,  # the interpreter's bf16 product: in fp32 (exact: bf16 fits)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M tile rows share the B columns they read while those are in L2
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % group_m)
    pid_n = (pid % per_group) // group_m

    # rows and columns past the edge wrap around (their results are never stored), so the
    # loads need no M/N mask. No max_contiguous hint: at the wrap the indices restart at 0,
    # and a vector load of a [K, N] weight's row would read past column N
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn_ = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rm[:, None].to(tl.int64) * sam + rk[None, :] * sak
    b_tile = b_ptr + rk[:, None] * sbk + rn_[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k * BLOCK_K
        a = tl.load(a_tile, mask=rk[None, :] < left, other=0.0)
        b = tl.load(b_tile, mask=rk[:, None] < left, other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if TF32:
            acc += tl.dot(a, b, input_precision="tf32")
        elif F32:  # float32 kept exact; 16-bit and FP8 tiles take the default
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_tile += BLOCK_K * sak
        b_tile += BLOCK_K * sbk

    # the epilogue, on the fp32 accumulator
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
    meta: dict[str, Any] = dict(
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        SCALED=precision == "fp8",
        ACT=_ACT_ID[activation],
        TF32=precision == "tf32",
        F32=a.dtype == torch.float32 or (interpreting() and a.dtype == torch.bfloat16),
        RN=rn_flag(dtype),
        # Triton 3.9's interpreter multiplies bf16 tiles wrongly (2e10 off on 16 x 16 randn);
        # bf16 values are exact in fp32, so the fp32 product is the same math
        UPCAST=interpreting() and a.dtype == torch.bfloat16,
    )
    if interpreting():
        bm, bn, bk = INTERPRET_BLOCKS
        meta.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)

        def grid(meta_: dict[str, Any]) -> tuple[int]:
            return (_triton.cdiv(m, bm) * _triton.cdiv(n, bn),)

    else:

        def grid(meta_: dict[str, Any]) -> tuple[int]:
            return (_triton.cdiv(m, meta_["BLOCK_M"]) * _triton.cdiv(n, meta_["BLOCK_N"]),)

    wrap_triton(_kernel(m, a2.element_size()))[grid](
        a2,
        bkn,
        c,
        bias if bias is not None else dummy,
        r2,
        scale_a if scale_a is not None else dummy,
        scale_b if scale_b is not None else dummy,
        m,
        n,
        k,
        m_bucket(m),
        a2.stride(0),
        a2.stride(1),
        bkn.stride(0),
        bkn.stride(1),
        r2.stride(0),
        r2.stride(1),
        **meta,
    )
    return c.reshape(*lead, n)


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
