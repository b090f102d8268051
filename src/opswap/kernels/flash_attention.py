"""FlashAttention's forward in Triton: softmax(q kᵀ · scale [+ causal mask] [+ key padding]) v
without the [S_q, S_k] scores ever reaching memory.

    from opswap.kernels.flash_attention import flash_attention
    o = flash_attention(q, k, v, causal=True)        # q [B, H, S_q, D], k, v [B, H_kv, S_k, D]

One program owns BLOCK_M query rows of one (batch, head) and walks the keys in tiles of
BLOCK_N: per tile, the scores s = q kᵀ (tensor cores, fp32 accumulation), the running
row maximum m and sum l of exp(s - m) (the online softmax: when the maximum grows by Δ,
the sum and the accumulated output so far are scaled by exp(-Δ)), and acc += p v. The
output is acc / l, and log-sum-exp m + log l is kept per row (what a backward needs).
Reads q once, k and v once per query block: O(S·D) memory traffic against the
O(S²) of the scores written and read back by matmul-softmax-matmul.

- `causal`: key j is seen by query i when j <= i, the upper-left alignment that
  `scaled_dot_product_attention(is_causal=True)` uses (also when S_q != S_k); tiles
  wholly above the diagonal are skipped, so causal does about half the work.
- `lengths` (int32 [B], optional): the number of valid keys per batch element, the
  padding mask of a batch of sequences padded at the end; keys past it are masked.
  A row that sees no key at all returns 0 (SDPA returns NaN there).
- Grouped-query attention: k and v have H_kv heads, H_kv dividing H; query head h reads
  kv head h // (H / H_kv), with no copy of k and v.
- Head dims 16 to 256, powers of two (64 and 128 are what models use); fp16, bf16 and
  fp32 inputs (fp32 goes through TF32 tensor cores on a GPU).
- The exp is exp2 with log2(e) folded into the scale, as the hardware has exp2.

Registered as `opswap::flash_attention` (a triton_op: torch.compile and torch.export see
the kernel; a fake implementation gives the output's shape). Gradients: the backward is
not a Triton kernel yet; it recomputes attention with PyTorch's SDPA math and
differentiates that, so training through the op is correct and as slow as eager
attention. On a CPU tensor (outside Triton's interpreter) the op is that reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.library import triton_op, wrap_triton

from opswap.kernels._rows import KernelError, interpreting, jitted, runs_triton, tl, triton

HEAD_DIMS = (16, 32, 64, 128, 256)
LOG2E = 1.4426950408889634


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors, or None when it can."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v must be [batch, heads, seq, head_dim]"
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return f"head dim {d} (q), {k.shape[-1]} (k), {v.shape[-1]} (v): the kernel takes one of {HEAD_DIMS}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (
        q.dtype == k.dtype == v.dtype
    ):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: the kernel takes one of fp16, bf16, fp32"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        return "q, k and v disagree on batch, or k and v on heads or length"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads"
    return None


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same function in PyTorch (SDPA's math, in q's dtype; float64 in the tests)."""
    h, hk = q.shape[1], k.shape[1]
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    mask = allowed[None, None]
    if lengths is not None:
        keys = torch.arange(sk, device=q.device)
        mask = mask & (keys[None, :] < lengths.to(q.device)[:, None])[:, None, None, :]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key: 0, as the kernel
    return p @ v


def _flash_fwd_fn(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,  # [B * H, S_q] fp32: the rows' log-sum-exp (natural log)
    len_ptr,  # [B] int32 valid keys (HAS_LEN)
    qk_scale,  # scale * log2(e)
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    som,
    H,
    GROUP,  # query heads per kv head
    M,  # S_q
    N,  # S_k
    CAUSAL: tl.constexpr,
    HAS_LEN: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr = False,  # the interpreter: its half-precision dot is not a GPU's
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    cols = tl.arange(0, BLOCK_N)
    q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    q = tl.load(q_base + rows[:, None] * sqm + dims[None, :], mask=rows[:, None] < M, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    n_keys = N
    if HAS_LEN:
        n_keys = tl.minimum(tl.load(len_ptr + b), N)
    hi = n_keys
    if CAUSAL:  # keys past the block's last row are masked for every row of it
        hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        keys = start + cols
        kt = tl.load(
            k_base + keys[None, :] * skn + dims[:, None], mask=keys[None, :] < n_keys, other=0.0
        )  # [D, BLOCK_N]
        if DOT_F32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt) * qk_scale
        ok = keys[None, :] < n_keys
        if CAUSAL:
            ok = ok & (keys[None, :] <= rows[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(
            v_base + keys[:, None] * svn + dims[None, :], mask=keys[:, None] < n_keys, other=0.0
        )  # [BLOCK_N, D]
        if DOT_F32:
            vt = vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_base = o_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(
        o_base + rows[:, None] * som + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=rows[:, None] < M,
    )
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, 0.0)
    tl.store(lse_ptr + bh.to(tl.int64) * M + rows, lse, mask=rows < M)


#: (BLOCK_M, BLOCK_N, num_warps, num_stages) tried per shape on a GPU; Hopper-sized tiles
#: first. The interpreter runs one small tile.
CONFIGS = (
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 32, 4, 4),
    (64, 64, 4, 3),
    (64, 32, 4, 4),
)
_TUNED: dict[tuple[Any, ...], Any] = {}


def _kernel(d: int) -> Any:
    """The forward kernel: autotuned over CONFIGS on a GPU (per S_q, S_k, head dim,
    causal), one 16 x 16 tile in the interpreter."""
    key = (interpreting(), d)
    if key not in _TUNED:
        fn = jitted(_flash_fwd_fn)
        if not interpreting():
            configs = [
                triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                for bm, bn, w, st in CONFIGS
                if not (d >= 256 and bm * bn > 64 * 64)  # registers: small tiles at 256
            ]
            fn = triton.autotune(configs, key=["M", "N", "D", "CAUSAL", "HAS_LEN"])(fn)
        _TUNED[key] = fn
    return _TUNED[key]


def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by `_flash_fwd_fn`: o like q, lse [B, H, S_q] fp32."""
    why = unsupported(q, k, v)
    if why is not None:
        raise KernelError(f"flash_attention: {why}.")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bsz, h, m, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((bsz, h, m), device=q.device, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse
    lens = lengths.to(device=q.device, dtype=torch.int32) if lengths is not None else lse
    kw: dict[str, Any] = {"CAUSAL": causal, "HAS_LEN": lengths is not None, "D": d}
    if interpreting():
        kw.update(BLOCK_M=16, BLOCK_N=16, DOT_F32=True)

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]), bsz * h)

    wrap_triton(_kernel(d))[grid](
        q,
        k,
        v,
        o,
        lse,
        lens,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        h,
        h // hk,
        m,
        n,
        **kw,
    )
    return o, lse


def _takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return runs_triton(q) and unsupported(q, k, v) is None


@triton_op("opswap::flash_attention", mutates_args=())
def _flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    lengths: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of q [B, H, S_q, D] over k, v [B, H_kv, S_k, D]; see the module docstring."""
    if _takes(q, k, v):
        return triton_forward(q, k, v, causal, scale, lengths)[0]
    return reference(q, k, v, causal, scale, lengths).to(q.dtype)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, v, causal, scale, lengths = inputs
    ctx.save_for_backward(q, k, v)
    ctx.causal, ctx.scale, ctx.lengths = causal, scale, lengths


def _backward(ctx: Any, do: torch.Tensor):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
        o = reference(qr, kr, vr, ctx.causal, ctx.scale, ctx.lengths)
        dq, dk, dv = torch.autograd.grad(o, (qr, kr, vr), do)
    return dq, dk, dv, None, None, None


_flash_attention.register_autograd(_backward, setup_context=_setup)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """`opswap::flash_attention`: softmax(q kᵀ · scale) v with the module docstring's masks;
    `scale` defaults to 1/sqrt(head_dim), as in SDPA."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return torch.ops.opswap.flash_attention(q, k, v, causal, s, lengths)


def sdpa(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """PyTorch's scaled_dot_product_attention with GQA expanded (the benchmark's peer)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
