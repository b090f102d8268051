"""Top-k over the last dim as `opswap::topk` (values and int64 indices, largest or smallest,
sorted or not), and the bucketed approximate top-k `opswap::approx_topk`.

Every path orders elements by one integer key: a float's bits b (as a signed int) made
order-preserving by flipping the magnitude bits of negatives, b ^ ((b >> 31) & 0x7fffffff),
so that integer order is float order (-inf < ... < -0 < +0 < ... < +inf); NaN gets the
largest key, as torch.topk and torch.sort place NaN above +inf. `smallest` flips the key.

Three kernels, one program per row:

- register path (rows up to REG_MAX elements): the row is loaded once as packed int64
  (key << 32 | (2^31 - 1 - column)) and sorted in registers by Triton's bitonic `tl.sort`;
  the first k are the answer, ties in column order. Reads n elements, writes k values and
  k indices: the minimum traffic; the sort is O(n log^2 n) compare-swaps in registers.
- tile merge (longer rows, k <= SMALL_K): the row in tiles of TILE; a sorted buffer of the
  best KP (k rounded up to a power of two) packed keys so far. A tile is merged (bitonic
  sort of the tile, its head joined with the buffer and sorted again) only when its best
  key beats the buffer's k-th; on random data that is the first tiles and O(k log(n/k))
  inserts after, so most tiles cost one read and one max.
- radix select (long rows, large k): histogram passes over the key's bytes (8 bits a
  pass: 4 passes for float32, 2 for float16/bfloat16, on the 16-bit key of the value
  itself), each narrowing the prefix of the k-th key; then one pass writes every element
  below that key and the first ones equal to it (a running cumsum over the tile gives
  each its slot, in column order). 5 reads of the row for float32, 3 for 16-bit dtypes,
  one write of k values and indices; `sorted` then sorts the k survivors (torch.sort,
  stable, so equal values stay in column order).

Semantics, all paths: the values are torch.topk's (identical, NaN included); among equal
values the indices come in ascending column order (torch.topk promises no order there).

CPU and anything the kernels do not take: torch.topk (`reference`).
"""

from __future__ import annotations

import math

import torch
from torch.library import wrap_triton

from opswap.kernels._rows import KernelError, jitted, rows_of, runs_triton, tl, triton
from opswap.kernels._triton_op import triton_op

#: the names the crossover table (kernels/crossover.py) measures these kernels under
CROSSOVER = ("topk",)
#: the longest row the register path sorts whole
REG_MAX = 4096
#: the largest k the tile-merge path keeps in its buffer
SMALL_K = 64
#: the tile the tile-merge and radix paths walk a row in
TILE = 1024
#: the recall@k the approximate top-k is held to by default
RECALL = 0.95


def reference(
    x: torch.Tensor, k: int, largest: bool = True, sorted: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over the last dim, outputs contiguous as the kernels write them."""
    v, i = torch.topk(x, k, dim=-1, largest=largest, sorted=sorted)
    return v.contiguous(), i.contiguous()


# ----------------------------------------------------------------------------- the kernels

if triton is not None:

    @triton.jit
    def topk_key32(x, LARGEST: tl.constexpr):
        # the order-preserving int32 key of fp32 x (NaN largest); flipped for smallest
        b = x.to(tl.int32, bitcast=True)
        key = b ^ ((b >> 31) & 0x7FFFFFFF)
        key = tl.where(x != x, 0x7FFFFFFF, key)
        if not LARGEST:
            key = ~key
        return key

    @triton.jit
    def topk_pack(x, col, ok, LARGEST: tl.constexpr):
        # key << 32 | (2^31 - 1 - col): larger is better, ties to the lower column; a
        # masked lane is INT32_MIN << 32 with low bits 0, below every real element
        key = tl.where(ok, topk_key32(x, LARGEST), -2147483648)
        low = tl.where(ok, 0x7FFFFFFF - col, 0)
        return (key.to(tl.int64) << 32) | low.to(tl.int64)


def _row_fn(
    x_ptr,  # [M, N], row stride sx
    v_ptr,  # [M, K]
    i_ptr,  # [M, K] int64
    N,
    K,
    sx,
    BLOCK: tl.constexpr,  # next power of two >= N
    LARGEST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.sort(topk_pack(x, cols, ok, LARGEST), descending=True)
    keep = cols < K
    idx = tl.where(keep, 0x7FFFFFFF - (s & 0xFFFFFFFF), 0)
    v = tl.load(x_ptr + row * sx + idx, mask=keep)
    tl.store(v_ptr + row * K + cols, v, mask=keep)
    tl.store(i_ptr + row * K + cols, idx, mask=keep)


def _tiles_fn(
    x_ptr,  # [M, N], row stride sx
    v_ptr,  # [M, K]
    i_ptr,  # [M, K] int64
    N,
    K,
    sx,
    TILE: tl.constexpr,
    KP: tl.constexpr,  # K rounded up to a power of two (>= 2)
    LARGEST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, TILE)
    kc = tl.arange(0, KP)
    floor = tl.full((KP,), -2147483648, tl.int32).to(tl.int64) << 32
    buf = floor  # the best KP packed keys so far, descending
    for start in range(0, N, TILE):
        c = start + cols
        ok = c < N
        x = tl.load(x_ptr + row * sx + c, mask=ok, other=0.0).to(tl.float32)
        p = topk_pack(x, c, ok, LARGEST)
        kth = tl.max(tl.where(kc == K - 1, buf, floor), 0)
        if tl.max(p, 0) > kth:
            s = tl.reshape(tl.sort(p, descending=True), (TILE // KP, KP))
            first = tl.arange(0, TILE // KP)[:, None] == 0
            head = tl.max(tl.where(first, s, floor[None, :]), 0)  # the tile's best KP
            both = tl.sort(tl.reshape(tl.join(buf, head), (2 * KP,)), descending=True)
            b2 = tl.reshape(both, (2, KP))
            buf = tl.max(tl.where(tl.arange(0, 2)[:, None] == 0, b2, floor[None, :]), 0)
    keep = kc < K
    idx = tl.where(keep, 0x7FFFFFFF - (buf & 0xFFFFFFFF), 0)
    v = tl.load(x_ptr + row * sx + idx, mask=keep)
    tl.store(v_ptr + row * K + kc, v, mask=keep)
    tl.store(i_ptr + row * K + kc, idx, mask=keep)


def _radix_fn(
    x_ptr,  # [M, N], row stride sx
    v_ptr,  # [M, K]
    i_ptr,  # [M, K] int64
    N,
    K,
    sx,
    TILE: tl.constexpr,
    BITS: tl.constexpr,  # 32 (float32) or 16 (float16, bfloat16): the key's width
    LARGEST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, TILE)
    bins = tl.arange(0, 512)
    top = (1 << BITS) - 1
    prefix = tl.sum(tl.zeros((1,), tl.int64), 0)  # the k-th key's bytes found so far
    kk = K  # how many of the k lie at or above the prefix still to place
    for p in tl.static_range(BITS // 8):
        shift: tl.constexpr = BITS - 8 * (p + 1)
        hist = tl.zeros((512,), tl.int32)
        for start in range(0, N, TILE):
            c = start + cols
            ok = c < N
            s = _select_key(x_ptr + row * sx + c, ok, BITS, LARGEST, top)
            match = ok & ((s >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(tl.where(match, (s >> shift) & 255, 256).to(tl.int32), 512)
        cum = tl.cumsum(tl.where(bins < 256, hist, 0), 0)
        under = cum < kk  # bins wholly inside the k
        digit = tl.sum(under.to(tl.int32), 0)
        kk = kk - tl.max(tl.where(under, cum, 0), 0)
        prefix = prefix | (digit.to(tl.int64) << shift)
    # every key below the k-th's, then the first kk equal to it, in column order
    n_lt = K - kk
    base_lt = tl.sum(tl.zeros((1,), tl.int32), 0)
    base_eq = base_lt
    for start in range(0, N, TILE):
        c = start + cols
        ok = c < N
        s = _select_key(x_ptr + row * sx + c, ok, BITS, LARGEST, top)
        lt = ok & (s < prefix)
        eq = ok & (s == prefix)
        r_lt = base_lt + tl.cumsum(lt.to(tl.int32), 0) - 1
        r_eq = base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        w = lt | (eq & (r_eq < kk))
        pos = tl.where(lt, r_lt, n_lt + r_eq)
        v = tl.load(x_ptr + row * sx + c, mask=w)
        tl.store(v_ptr + row * K + pos, v, mask=w)
        tl.store(i_ptr + row * K + pos, c.to(tl.int64), mask=w)
        base_lt += tl.sum(lt.to(tl.int32), 0)
        base_eq += tl.sum(eq.to(tl.int32), 0)


if triton is not None:

    @triton.jit
    def _select_key(ptr, ok, BITS: tl.constexpr, LARGEST: tl.constexpr, top):
        # the unsigned order key in [0, 2^BITS) with the wanted elements smallest
        raw = tl.load(ptr, mask=ok, other=0.0)
        if BITS == 32:
            key = topk_key32(raw.to(tl.float32), True).to(tl.int64) + 2147483648
        else:
            b = raw.to(tl.int16, bitcast=True).to(tl.int32)
            k16 = b ^ ((b >> 15) & 0x7FFF)
            f = raw.to(tl.float32)  # NaN test in fp32: any NaN bits (0xffff too) are NaN
            k16 = tl.where(f != f, 0x7FFF, k16)
            key = (k16 + 32768).to(tl.int64)
        if LARGEST:
            key = top - key
        return key


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


#: row-count buckets of the crossover table's top-k classes (the benchmark's grid)
ROW_BUCKETS = (1, 16, 256, 4096)


def shape_class(n: int, k: int, rows: int) -> str:
    """The crossover table's class of a top-k: 'n<=4096,k<=64,rows<=256' (row length and k
    rounded up to powers of two, the rows to ROW_BUCKETS; 'rows>4096' past the last)."""
    r = next((f"rows<={b}" for b in ROW_BUCKETS if rows <= b), f"rows>{ROW_BUCKETS[-1]}")
    return f"n<={_pow2(n)},k<={_pow2(k)},{r}"


def path(n: int, k: int) -> str:
    """Which kernel takes rows of n elements for this k: "register", "tiles" or "radix"."""
    if n <= REG_MAX:
        return "register"
    return "tiles" if k <= SMALL_K else "radix"


def triton_forward(
    x: torch.Tensor, k: int, largest: bool = True, sorted: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of x [..., N] over its last dim by the kernel `path` picks."""
    n = x.shape[-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    vals = torch.empty((m, k), device=x.device, dtype=x.dtype)
    idx = torch.empty((m, k), device=x.device, dtype=torch.int64)
    if m and k:
        how = path(n, k)
        if how == "register":
            block = max(16, _pow2(n))
            wrap_triton(jitted(_row_fn))[(m,)](
                x2, vals, idx, n, k, x2.stride(0), BLOCK=block, LARGEST=largest,
                num_warps=4 if block <= 1024 else 8,
            )  # fmt: skip
        elif how == "tiles":
            wrap_triton(jitted(_tiles_fn))[(m,)](
                x2, vals, idx, n, k, x2.stride(0), TILE=TILE, KP=max(2, _pow2(k)),
                LARGEST=largest, num_warps=8,
            )  # fmt: skip
        else:
            bits = 32 if x.dtype == torch.float32 else 16
            wrap_triton(jitted(_radix_fn))[(m,)](
                x2, vals, idx, n, k, x2.stride(0), TILE=TILE, BITS=bits, LARGEST=largest,
                num_warps=8,
            )  # fmt: skip
            if sorted:
                vals, perm = torch.sort(vals, dim=-1, descending=largest, stable=True)
                idx = idx.gather(-1, perm)
    shape = (*x.shape[:-1], k)
    return vals.reshape(shape), idx.reshape(shape)


def _check(x: torch.Tensor, k: int) -> None:
    if x.dim() == 0:
        raise KernelError("opswap::topk takes a tensor of at least one dim, not a scalar.")
    if not 0 <= k <= x.shape[-1]:
        raise KernelError(
            f"k={k} is out of range for a last dim of {x.shape[-1]}; pick 0 <= k <= {x.shape[-1]}."
        )


def _kernel_takes(x: torch.Tensor, k: int) -> bool:
    return (
        runs_triton(x)
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and k > 0
        and x.shape[-1] < 2**31 - 1
    )


# ----------------------------------------------------------------------------- the ops


@triton_op("opswap::topk", mutates_args=())
def topk(x: torch.Tensor, k: int, largest: bool, sorted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest (or smallest) of x over its last dim: (values, int64 indices)."""
    _check(x, k)
    if _kernel_takes(x, k):
        return triton_forward(x, k, largest, sorted)
    return reference(x, k, largest, sorted)


def buckets_for(n: int, k: int, recall: float = RECALL) -> tuple[int, int]:
    """(buckets B, survivors a bucket k') for rows of n: the fewest survivors a bucket (the
    first pass's cost grows with k'; k' = 1 is a plain max), with the fewest buckets that
    keep the expected recall@k on exchangeable data at or above `recall`. A true top-k
    element is lost only when more than k' of the k fall in its bucket: with the k spread
    uniformly over B buckets, the count beside it in its own bucket is Binomial(k - 1,
    1 / B), and its recall is P(count < k'). (1, k) when no split qualifies."""
    for kp in range(1, k + 1):
        for b in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
            if b > n // 2 or kp > n // b:
                break
            if n % b or kp * b < k:
                continue
            if _binom_cdf(k - 1, 1.0 / b, kp - 1) >= recall:
                return b, kp
    return 1, k


def _binom_cdf(n: int, p: float, at: int) -> float:
    """P(Binomial(n, p) <= at)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, min(at, n) + 1))


def approx_reference(
    x: torch.Tensor, k: int, largest: bool, buckets: int, per_bucket: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucketed top-k: x's row split into `buckets` contiguous buckets (a view, no
    copy), the top `per_bucket` of each (a max when it is 1), then the exact top-k of
    those survivors, sorted; indices into the row."""
    n = x.shape[-1]
    if buckets <= 1:
        return reference(x, k, largest, True)
    lead = x.shape[:-1]
    width = n // buckets
    grid = x.reshape(*lead, buckets, width)  # [..., B, n / B]
    if per_bucket == 1:
        v1, i1 = grid.max(-1, keepdim=True) if largest else grid.min(-1, keepdim=True)
    else:
        v1, i1 = torch.ops.opswap.topk.default(grid, per_bucket, largest, False)
    cols = i1 + width * torch.arange(buckets, device=x.device)[:, None]  # [..., B, k']
    v2, i2 = torch.topk(v1.reshape(*lead, -1), k, dim=-1, largest=largest, sorted=True)
    return v2.contiguous(), cols.reshape(*lead, -1).gather(-1, i2).contiguous()


@torch.library.custom_op("opswap::approx_topk", mutates_args=())
def approx_topk(
    x: torch.Tensor, k: int, largest: bool, buckets: int, per_bucket: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucketed approximate top-k of x's last dim (sorted; see `approx_reference`).
    A row whose length the buckets do not divide, or too short to give each bucket
    `per_bucket` survivors, takes the exact top-k (a dynamic row length may do that)."""
    _check(x, k)
    if buckets < 1 or per_bucket < 1 or per_bucket * buckets < k:
        raise KernelError(
            f"{buckets} buckets of {per_bucket} survivors cannot hold k={k}; "
            "use buckets_for(n, k) to pick them."
        )
    n = x.shape[-1]
    if n % buckets or per_bucket > n // buckets:
        return reference(x, k, largest, True)
    return approx_reference(x, k, largest, buckets, per_bucket)


@approx_topk.register_fake
def _approx_fake(
    x: torch.Tensor, k: int, largest: bool, buckets: int, per_bucket: int
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)
