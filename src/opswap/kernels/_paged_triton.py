"""The Triton kernels of `paged_attention` (the why, the ops and their launch are there):
the decode split kernel, the combine of its splits, and the chunked-prefill kernel. Keys
are read through the block table: key t of a sequence at block `table[t // BLOCK_SIZE]`,
slot `t % BLOCK_SIZE` of the pool [num_blocks, BLOCK_SIZE, H_kv, D]; BLOCK_D is the head
dim D rounded up to a power of two (>= 16), its padding masked."""

from __future__ import annotations

from opswap.kernels._rows import rn, tl, triton

# The helpers both attention kernels call, named where they are defined (as `rn` is,
# kernels/_rows.py, for Inductor's copy of their source).
if triton is not None:

    @triton.jit
    def _kv_tile(
        table, k_head, v_head, keys, valid, dims, in_d, skb, skn, svb, svn,
        BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        # K and V rows [BLOCK_N, BLOCK_D] of the tile's keys (mask valid), each read at
        # block table[key // BLOCK_SIZE], slot key % BLOCK_SIZE
        blk = tl.load(table + keys // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = (keys % BLOCK_SIZE).to(tl.int64)
        where = valid[:, None] & in_d[None, :]
        kt = tl.load(
            k_head + (blk * skb + slot * skn)[:, None] + dims[None, :], mask=where, other=0.0
        )
        vt = tl.load(
            v_head + (blk * svb + slot * svn)[:, None] + dims[None, :], mask=where, other=0.0
        )
        if DOT_F32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        return kt, vt

    @triton.jit
    def _online_step(s, vt, m_i, l_i, acc, PREC: tl.constexpr):
        # one tile of the online softmax: s [rows, BLOCK_N] scaled log2 scores (-inf where
        # masked; each row with a finite one), vt its values; the running max, sum and
        # output rescaled to the new max
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        return m_new, l_i, acc

else:  # pragma: no cover
    _kv_tile = _online_step = None


def _paged_decode_fn(
    q_ptr,  # [B, H, D]
    k_ptr,  # [num_blocks, block_size, H_kv, D]
    v_ptr,  # [num_blocks, block_size, H_kv, D]
    table_ptr,  # [B, max_blocks] int: the sequence's blocks in order
    len_ptr,  # [B] int: cached tokens per sequence
    o_ptr,  # [B * H, SPLITS, BLOCK_D] fp32: each split's output, normalised within the split
    lse_ptr,  # [B * H, SPLITS] fp32: each split's log2-sum-exp2 of the scaled scores
    out_ptr,  # [B, H, D], q's dtype: written here when DIRECT, else by the combine
    sob,
    soh,
    qk_scale,  # scale * log2(e)
    sqb,
    sqh,
    skb,
    skn,
    skh,
    svb,
    svn,
    svh,
    stb,
    H_KV,
    GROUP,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # block size (a constant: a power of two divides by a shift)
    S_MAX,  # max_blocks * block_size: the longest context the table can name
    SPLIT_LEN,
    SPLITS,
    D,
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two (>= 16)
    BLOCK_G: tl.constexpr,  # GROUP padded to a tile height tl.dot takes (>= 16)
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,  # the interpreter: its half-precision dot is not a GPU's
    DIRECT: tl.constexpr,  # one split: write the output itself, no combine
    RN: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)  # a SymFloat may arrive as fp64
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H_KV
    hk = pid % H_KV
    n_keys = tl.minimum(tl.load(len_ptr + b), S_MAX)
    lo = split * SPLIT_LEN
    g = tl.arange(0, BLOCK_G)
    heads = hk * GROUP + g
    in_group = g < GROUP
    dims = tl.arange(0, BLOCK_D)
    in_d = dims < D
    out = out_ptr + b.to(tl.int64) * sob + heads[:, None] * soh + dims[None, :]
    if lo >= n_keys:  # a split wholly past this sequence's keys: nothing to read
        if DIRECT:  # a sequence with no key at all gets 0, as the combine gives it
            zero = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            tl.store(out, zero.to(out_ptr.dtype.element_ty), mask=in_group[:, None] & in_d[None, :])
        return
    hi = tl.minimum(lo + SPLIT_LEN, n_keys)
    cols = tl.arange(0, BLOCK_N)
    q_base = q_ptr + b.to(tl.int64) * sqb
    q = tl.load(
        q_base + heads[:, None] * sqh + dims[None, :],
        mask=in_group[:, None] & in_d[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    table = table_ptr + b.to(tl.int64) * stb
    k_head = k_ptr + hk.to(tl.int64) * skh
    v_head = v_ptr + hk.to(tl.int64) * svh
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + cols
        valid = keys < hi
        kt, vt = _kv_tile(
            table, k_head, v_head, keys, valid, dims, in_d, skb, skn, svb, svn, BLOCK_SIZE, DOT_F32
        )
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # every tile holds at least one valid key (start < hi), so m_new is finite
        m_i, l_i, acc = _online_step(s, vt, m_i, l_i, acc, PREC)
    if DIRECT:
        o = rn(acc / l_i[:, None], RN).to(out_ptr.dtype.element_ty)
        tl.store(out, o, mask=in_group[:, None] & in_d[None, :])
    else:
        row = (b * H_KV * GROUP + heads).to(tl.int64) * SPLITS + split
        part = o_ptr + row[:, None] * BLOCK_D + dims[None, :]
        tl.store(part, acc / l_i[:, None], mask=in_group[:, None])
        tl.store(lse_ptr + row, m_i + tl.log2(l_i), mask=in_group)


def _paged_combine_fn(
    o_part_ptr,  # [B * H, SPLITS, BLOCK_D] fp32
    lse_ptr,  # [B * H, SPLITS] fp32 (log2 domain)
    len_ptr,  # [B] int
    out_ptr,  # [B, H, D], q's dtype
    sob,
    soh,
    H,
    S_MAX,
    SPLIT_LEN,
    SPLITS,
    D,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # SPLITS padded to a power of two
    RN: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    n_keys = tl.minimum(tl.load(len_ptr + b), S_MAX)
    splits = tl.arange(0, BLOCK_S)
    used = splits < (n_keys + SPLIT_LEN - 1) // SPLIT_LEN  # the splits that wrote
    dims = tl.arange(0, BLOCK_D)
    base = bh.to(tl.int64) * SPLITS
    lse = tl.load(lse_ptr + base + splits, mask=used, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key at all: every weight is 0
    w = tl.exp2(lse - top)
    parts = tl.load(
        o_part_ptr + (base + splits)[:, None] * BLOCK_D + dims[None, :],
        mask=used[:, None],
        other=0.0,
    )
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(den > 0.0, den, 1.0)  # 0 when no key
    o = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + dims
    tl.store(o, rn(out, RN).to(out_ptr.dtype.element_ty), mask=dims < D)


def _paged_prefill_fn(
    q_ptr,  # [T, H, D]: the chunks packed
    k_ptr,  # [num_blocks, block_size, H_kv, D]
    v_ptr,
    table_ptr,  # [S, max_blocks] int
    cu_ptr,  # [S + 1] int: chunk s is rows cu[s]:cu[s + 1] of q
    len_ptr,  # [S] int: cached tokens per sequence, the chunk's own included
    tiles_ptr,  # [S + 1] int32: the first query tile of each sequence (exclusive cumsum)
    o_ptr,  # [T, H, D], q's dtype
    qk_scale,
    sqt,
    sqh,
    skb,
    skn,
    skh,
    svb,
    svn,
    svh,
    stb,
    sot,
    soh,
    S,  # sequences
    GROUP,
    BLOCK_SIZE: tl.constexpr,
    D,
    STEPS: tl.constexpr,  # binary-search steps over the S + 1 tile starts
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    RN: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    # the integer tensors are read as int32 whatever their type (sizes fit)
    if pid >= tl.load(tiles_ptr + S).to(tl.int32):  # the grid is a bound on the tile count
        return
    # the sequence whose tiles hold pid: the last s with tiles[s] <= pid
    lo = pid * 0
    hi = lo + S
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        below = tl.load(tiles_ptr + mid).to(tl.int32) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    seq = lo
    first = tl.load(cu_ptr + seq).to(tl.int32)
    chunk = tl.load(cu_ptr + seq + 1).to(tl.int32) - first
    n_keys = tl.load(len_ptr + seq).to(tl.int32)
    tile = pid - tl.load(tiles_ptr + seq).to(tl.int32)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    in_chunk = rows < chunk
    pos = n_keys - chunk + rows  # each query's own position: it sees keys 0..pos
    hi_key = tl.minimum(n_keys, n_keys - chunk + (tile + 1) * BLOCK_M)
    hk = h // GROUP
    dims = tl.arange(0, BLOCK_D)
    in_d = dims < D
    cols = tl.arange(0, BLOCK_N)
    q_rows = (first + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * sqt + h * sqh + dims[None, :],
        mask=in_chunk[:, None] & in_d[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    table = table_ptr + seq.to(tl.int64) * stb
    k_head = k_ptr + hk.to(tl.int64) * skh
    v_head = v_ptr + hk.to(tl.int64) * svh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, hi_key, BLOCK_N):
        keys = start + cols
        valid = keys < hi_key
        kt, vt = _kv_tile(
            table, k_head, v_head, keys, valid, dims, in_d, skb, skn, svb, svn, BLOCK_SIZE, DOT_F32
        )
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
        # key 0 is in the first tile and every position is >= 0: m_new is finite
        m_i, l_i, acc = _online_step(s, vt, m_i, l_i, acc, PREC)
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * sot + h * soh + dims[None, :],
        rn(out, RN).to(o_ptr.dtype.element_ty),
        mask=in_chunk[:, None] & in_d[None, :],
    )
