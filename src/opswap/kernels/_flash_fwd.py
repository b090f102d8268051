"""FlashAttention's forward kernel (opswap.kernels.flash_attention holds the op around it).

One program owns BLOCK_M query rows of one (batch, head) and walks the keys in tiles of
BLOCK_N: per tile, the scores s = q kᵀ (tensor cores, fp32 accumulation), the running
row maximum m and sum l of exp(s - m) (the online softmax: when the maximum grows by Δ,
the sum and the output accumulated so far are scaled by exp(-Δ)), and acc += p v. The
output is acc / l, and the log-sum-exp m + log l is kept per row for the backward.
Memory traffic: q read once, k and v once per query block, o written once, O(S·D); the
matmul-softmax-matmul it replaces writes and reads the O(S²) scores (and probabilities).
The exp is exp2 with log2(e) folded into the scale, as the hardware has exp2.

Tiles wholly above the causal diagonal or wholly past a row's valid keys are not visited;
tiles wholly inside both need no mask and skip the `where`. With USE_TMA (Hopper, a
Triton with device-side tensor descriptors) k and v tiles come through the bulk tensor
copy engine (`tl.make_tensor_descriptor`); otherwise plain masked pointer loads.
"""

from __future__ import annotations

from opswap.kernels._rows import rn, tl


def _flash_fwd_fn(
    q_ptr,  # [B, H, S_q, D]
    k_ptr,  # [B, H_kv, S_k, D]
    v_ptr,  # [B, H_kv, S_k, D]
    o_ptr,  # [B, H, S_q, D], q's dtype
    lse_ptr,  # [B * H, S_q] fp32: the rows' log-sum-exp (natural log)
    len_ptr,  # [B] int32 valid keys (HAS_LEN)
    mask_ptr,  # [B, H, S_q, S_k] by strides (0 where broadcast): additive or bool (HAS_MASK)
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
    smb,
    smh,
    smm,
    smn,
    H,
    GROUP,  # query heads per kv head
    M,  # S_q
    N,  # S_k
    CAUSAL: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,  # tl.dot's input_precision: "ieee" keeps fp32 inputs fp32
    USE_TMA: tl.constexpr,
    DOT_F32: tl.constexpr,  # the interpreter: its half-precision dot is not a GPU's
    RN: tl.constexpr,
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    qk_scale = tl.cast(qk_scale, tl.float32)
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
    m_base = mask_ptr + b.to(tl.int64) * smb + h.to(tl.int64) * smh
    q = tl.load(q_base + rows[:, None] * sqm + dims[None, :], mask=rows[:, None] < M, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    n_keys = N
    if HAS_LEN:
        n_keys = tl.minimum(tl.load(len_ptr + b), N)
    hi = n_keys
    if CAUSAL:  # keys past the block's last row are masked for every row of it
        hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M)
    # tiles [0, safe) are wholly visible to every row of the block: no mask to apply
    safe = n_keys // BLOCK_N * BLOCK_N
    if CAUSAL:
        safe = tl.minimum(safe, pid_m * BLOCK_M // BLOCK_N * BLOCK_N)
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(
            k_base, shape=[N, D], strides=[skn, 1], block_shape=[BLOCK_N, D]
        )
        v_desc = tl.make_tensor_descriptor(
            v_base, shape=[N, D], strides=[svn, 1], block_shape=[BLOCK_N, D]
        )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        keys = start + cols
        if USE_TMA:
            kt = k_desc.load([start, 0])  # [BLOCK_N, D], zero past N
            vt = v_desc.load([start, 0])
            if HAS_LEN:  # padding keys may hold anything; p is 0 there, so must v be
                vt = tl.where(keys[:, None] < n_keys, vt, 0.0)
        else:
            kt = tl.load(
                k_base + keys[:, None] * skn + dims[None, :],
                mask=keys[:, None] < n_keys,
                other=0.0,
            )
            vt = tl.load(
                v_base + keys[:, None] * svn + dims[None, :],
                mask=keys[:, None] < n_keys,
                other=0.0,
            )
        if DOT_F32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale
        if HAS_MASK:
            mp = m_base + rows[:, None] * smm + keys[None, :] * smn
            inside = (rows[:, None] < M) & (keys[None, :] < N)
            if MASK_BOOL:
                s = tl.where(tl.load(mp, mask=inside, other=0) != 0, s, float("-inf"))
            else:
                s += tl.load(mp, mask=inside, other=0.0).to(tl.float32) * 1.4426950408889634
        if start >= safe:
            ok = keys[None, :] < n_keys
            if CAUSAL:
                ok = ok & (keys[None, :] <= rows[:, None])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_base = o_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(
        o_base + rows[:, None] * som + dims[None, :],
        rn(out, RN).to(o_ptr.dtype.element_ty),
        mask=rows[:, None] < M,
    )
    # a row that sees no key: lse 0 and output 0 (SDPA's math gives 0 there too)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, 0.0)
    tl.store(lse_ptr + bh.to(tl.int64) * M + rows, lse, mask=rows < M)
