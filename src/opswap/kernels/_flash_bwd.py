"""FlashAttention's backward kernels (the FlashAttention-2 scheme; the op is in
opswap.kernels.flash_attention).

With P = softmax(S), S = q kᵀ · scale (+ mask), O = P v and the forward's log-sum-exp L:

    dV = Pᵀ dO      dP = dO vᵀ      dS = P ∘ (dP - δ),  δ = rowsum(dO ∘ O)
    dQ = dS k · scale               dK = dSᵀ q · scale

P is never stored: each kernel recomputes a tile of it from q, k and L (P = exp(S - L)).

1. `_flash_bwd_pre_fn`: δ per query row (reads O and dO once).
2. `_flash_bwd_dkdv_fn`: one program per BLOCK_N keys of one (batch, kv head); it walks
   the query tiles of every query head of the kv head's group and accumulates dK, dV in
   registers, so grouped-query heads are summed without atomics or a repeat of k, v.
3. `_flash_bwd_dq_fn`: one program per BLOCK_M query rows, walking the key tiles as the
   forward does, accumulating dQ.

Why two kernels rather than one with atomic adds into an fp32 dQ: no atomics means the
gradients are deterministic (bit-identical run to run), dQ is written once in the input
dtype without an fp32 scratch buffer and a cast, and the interpreter runs the same code.
The price is S and P computed twice (7 tile matmuls instead of 5); the FLOP count the
benchmark reports (2.5x the forward's) counts the 5.
"""

from __future__ import annotations

from opswap.kernels._rows import rn, tl


def _flash_bwd_pre_fn(
    o_ptr,  # [B, H, S_q, D]
    do_ptr,  # [B, H, S_q, D]
    delta_ptr,  # [B * H, S_q] fp32
    sob,
    soh,
    som,
    sdb,
    sdh,
    sdm,
    H,
    M,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    inside = rows[:, None] < M
    o = tl.load(
        o_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + rows[:, None] * som + dims[None, :],
        mask=inside,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        do_ptr + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + rows[:, None] * sdm + dims[None, :],
        mask=inside,
        other=0.0,
    ).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * M + rows, tl.sum(o * do, 1), mask=rows < M)


def _flash_bwd_dkdv_fn(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,  # dO, strides like q's (the wrapper makes it so)
    dk_ptr,  # like k, contiguous
    dv_ptr,  # like v, contiguous
    lse_ptr,  # [B * H, S_q] fp32
    delta_ptr,  # [B * H, S_q] fp32
    len_ptr,
    mask_ptr,
    qk_scale,  # scale * log2(e)
    scale,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdkb,
    sdkh,
    sdkn,
    smb,
    smh,
    smm,
    smn,
    H,
    HK,
    GROUP,
    M,
    N,
    CAUSAL: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    RN: tl.constexpr,
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HK
    hk = bhk % HK
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    n_keys = N
    if HAS_LEN:
        n_keys = tl.minimum(tl.load(len_ptr + b), N)
    kmask = keys[:, None] < n_keys
    kt = tl.load(
        k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + keys[:, None] * skn + dims[None, :],
        mask=kmask,
        other=0.0,
    )  # [BLOCK_N, D]
    vt = tl.load(
        v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + keys[:, None] * svn + dims[None, :],
        mask=kmask,
        other=0.0,
    )
    if DOT_F32:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    rows0 = tl.arange(0, BLOCK_M)
    lo = 0
    if CAUSAL:  # rows above the block's first key see none of it
        lo = pid_n * BLOCK_N // BLOCK_M * BLOCK_M
    hi = M
    if pid_n * BLOCK_N >= n_keys:  # padding keys only: their gradients are 0
        hi = 0
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_base = do_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        m_base = mask_ptr + b.to(tl.int64) * smb + h.to(tl.int64) * smh
        for start in range(lo, hi, BLOCK_M):
            rows = start + rows0
            rmask = rows < M
            q = tl.load(
                q_base + rows[:, None] * sqm + dims[None, :], mask=rmask[:, None], other=0.0
            )
            do = tl.load(
                do_base + rows[:, None] * sqm + dims[None, :], mask=rmask[:, None], other=0.0
            )
            if DOT_F32:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_ptr + bh.to(tl.int64) * M + rows, mask=rmask, other=0.0)
            delta = tl.load(delta_ptr + bh.to(tl.int64) * M + rows, mask=rmask, other=0.0)
            st = tl.dot(kt, tl.trans(q), input_precision=PREC) * qk_scale  # sᵀ [BLOCK_N, BLOCK_M]
            if HAS_MASK:
                mp = m_base + rows[None, :] * smm + keys[:, None] * smn
                inside = rmask[None, :] & (keys[:, None] < N)
                if MASK_BOOL:
                    st = tl.where(tl.load(mp, mask=inside, other=0) != 0, st, float("-inf"))
                else:
                    st += tl.load(mp, mask=inside, other=0.0).to(tl.float32) * 1.4426950408889634
            ok = (keys[:, None] < n_keys) & rmask[None, :]
            if CAUSAL:
                ok = ok & (keys[:, None] <= rows[None, :])
            pt = tl.where(ok, tl.exp2(st - lse[None, :] * 1.4426950408889634), 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
            dpt = tl.dot(vt, tl.trans(do), input_precision=PREC)  # [BLOCK_N, BLOCK_M]
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    dk *= scale
    out = keys[:, None] < N
    off = b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + keys[:, None] * sdkn + dims[None, :]
    tl.store(dk_ptr + off, rn(dk, RN).to(dk_ptr.dtype.element_ty), mask=out)
    tl.store(dv_ptr + off, rn(dv, RN).to(dv_ptr.dtype.element_ty), mask=out)


def _flash_bwd_dq_fn(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,  # strides like q's
    dq_ptr,  # like q, contiguous
    lse_ptr,
    delta_ptr,
    len_ptr,
    mask_ptr,
    qk_scale,
    scale,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdqb,
    sdqh,
    sdqm,
    smb,
    smh,
    smm,
    smn,
    H,
    GROUP,
    M,
    N,
    CAUSAL: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    RN: tl.constexpr,
):
    # a float argument may arrive as fp64 (inductor types a SymFloat so): fp32 math
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    q_off = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows[:, None] * sqm + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=rmask[:, None], other=0.0)
    do = tl.load(do_ptr + q_off, mask=rmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * M + rows, mask=rmask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + bh.to(tl.int64) * M + rows, mask=rmask, other=0.0)
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    m_base = mask_ptr + b.to(tl.int64) * smb + h.to(tl.int64) * smh
    n_keys = N
    if HAS_LEN:
        n_keys = tl.minimum(tl.load(len_ptr + b), N)
    hi = n_keys
    if CAUSAL:
        hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M)
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        keys = start + cols
        kmask = keys[:, None] < n_keys
        kt = tl.load(k_base + keys[:, None] * skn + dims[None, :], mask=kmask, other=0.0)
        vt = tl.load(v_base + keys[:, None] * svn + dims[None, :], mask=kmask, other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale
        if HAS_MASK:
            mp = m_base + rows[:, None] * smm + keys[None, :] * smn
            inside = rmask[:, None] & (keys[None, :] < N)
            if MASK_BOOL:
                s = tl.where(tl.load(mp, mask=inside, other=0) != 0, s, float("-inf"))
            else:
                s += tl.load(mp, mask=inside, other=0.0).to(tl.float32) * 1.4426950408889634
        ok = (keys[None, :] < n_keys) & rmask[:, None]
        if CAUSAL:
            ok = ok & (keys[None, :] <= rows[:, None])
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vt), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), kt, input_precision=PREC)
    dq *= scale
    off = b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + rows[:, None] * sdqm + dims[None, :]
    tl.store(dq_ptr + off, rn(dq, RN).to(dq_ptr.dtype.element_ty), mask=rmask[:, None])
