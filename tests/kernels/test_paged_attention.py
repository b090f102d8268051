"""The paged-attention references against plain attention on the same tokens, laid out in
shuffled blocks, at odd lengths and with grouped-query heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opswap.kernels import paged_attention as pa


def _paged(keys: list[torch.Tensor], block: int, kv_heads: int, d: int, seed: int = 0):
    """Scatter each sequence's [length, kv_heads, d] keys into a shuffled block pool."""
    g = torch.Generator().manual_seed(seed)
    need = [(k.shape[0] + block - 1) // block for k in keys]
    pool = torch.randperm(sum(need) + 3, generator=g)
    cache = torch.randn(len(pool), block, kv_heads, d, generator=g)  # garbage elsewhere
    tables = torch.zeros(len(keys), max(need), dtype=torch.int32)
    used = 0
    for s, k in enumerate(keys):
        ids = pool[used : used + need[s]]
        used += need[s]
        tables[s, : need[s]] = ids.int()
        flat = torch.zeros(need[s] * block, kv_heads, d)
        flat[: k.shape[0]] = k
        cache[ids] = flat.view(need[s], block, kv_heads, d)
    return cache, tables


@pytest.mark.parametrize(("heads", "kv_heads", "block"), [(4, 4, 16), (6, 2, 5), (8, 1, 3)])
def test_decode_matches_attention_on_the_gathered_tokens(heads, kv_heads, block):
    torch.manual_seed(0)
    d, lengths = 8, [1, 7, 23]
    ks = [torch.randn(n, kv_heads, d) for n in lengths]
    vs = [torch.randn(n, kv_heads, d) for n in lengths]
    kc, tables = _paged(ks, block, kv_heads, d)
    vc, same = _paged(vs, block, kv_heads, d)  # the same seed: the same blocks
    assert torch.equal(tables, same)
    q = torch.randn(len(lengths), heads, d)
    got = pa.paged_decode_attention(q, kc, vc, tables, torch.tensor(lengths), d**-0.5)
    for s in range(len(lengths)):
        k = ks[s].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = vs[s].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        want = F.scaled_dot_product_attention(q[s][:, None], k, v)[:, 0]
        torch.testing.assert_close(got[s], want, atol=1e-5, rtol=1e-5)


def test_prefill_chunks_attend_causally_after_their_prefix():
    torch.manual_seed(1)
    heads, kv_heads, d, block = 4, 2, 8, 4
    lengths, chunks = [9, 5], [3, 5]  # sequence 0: 6 cached + a chunk of 3; 1: all new
    ks = [torch.randn(n, kv_heads, d) for n in lengths]
    kc, tables = _paged(ks, block, kv_heads, d)
    vc = kc.clone()  # values = keys: enough to check the positions read
    q = torch.randn(sum(chunks), heads, d)
    cu = torch.tensor([0, chunks[0], sum(chunks)])
    got = pa.paged_prefill_attention(q, kc, vc, tables, cu, torch.tensor(lengths), 0.3)
    for s, (n, c) in enumerate(zip(lengths, chunks, strict=True)):
        k = ks[s].transpose(0, 1).repeat_interleave(2, 0)
        qs = q[cu[s] : cu[s + 1]].transpose(0, 1)
        mask = torch.ones(c, n, dtype=torch.bool).tril(n - c)
        want = F.scaled_dot_product_attention(qs, k, k, attn_mask=mask, scale=0.3)
        torch.testing.assert_close(
            got[cu[s] : cu[s + 1]], want.transpose(0, 1), atol=1e-5, rtol=1e-5
        )


def test_mismatched_heads_are_refused_in_one_sentence():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        pa.paged_decode_attention(
            torch.randn(1, 5, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8),
            torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]), 1.0,
        )  # fmt: skip
