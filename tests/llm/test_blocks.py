"""opswap.llm.blocks: allocation, reference counts and the free list; prefix caching by
hash chain (sharing, the last token left to compute, LRU eviction only when the free list
is empty); the pool's statistics; one-sentence errors."""

from __future__ import annotations

import pytest

from opswap.errors import OpswapError
from opswap.llm import BlockError, BlockManager

# small ops on 2 threads stall whenever another process holds a core (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_tables_grow_by_blocks_and_every_block_comes_back():
    bm = BlockManager(num_blocks=7, block_size=4)
    assert bm.blocks_needed("a", 9) == 3
    table = bm.allocate("a", 9)
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.allocate("a", 12) == table  # the third block still has room
    assert len(bm.allocate("a", 13)) == 4
    bm.allocate("b", 3)
    assert bm.stats().in_use == 5 and bm.num_free() == 2
    assert not bm.can_allocate("b", 13) and bm.can_allocate("b", 12)
    with pytest.raises(BlockError, match="needs 3 more KV blocks but 2 are free"):
        bm.allocate("b", 13)
    bm.free("a")
    bm.free("b")
    s = bm.stats()
    assert s.in_use == 0 and s.free == 7


def test_a_shared_prefix_reuses_the_cached_blocks_and_counts_the_hits():
    bs = 5
    bm = BlockManager(num_blocks=20, block_size=bs)
    prefix = _ids(3 * bs, 100)
    a = prefix + [1, 2]
    assert bm.admit("a", a) == 0
    bm.allocate("a", len(a))
    bm.commit("a", a, len(a))
    b = prefix + [7, 8, 9, 10]
    assert bm.admit("b", b) == 3 * bs
    assert bm.table("b") == bm.table("a")[:3]
    bm.allocate("b", len(b))
    assert bm.table("b")[3] != bm.table("a")[3]  # past the prefix, its own block
    s = bm.stats()
    assert s.hit_blocks == 3 and s.queried_blocks == 3 + 3  # a looked up 3, b 3
    assert s.in_use == 5
    bm.free("a")
    assert bm.stats().in_use == 4  # the shared blocks are still b's
    bm.free("b")
    assert bm.stats().in_use == 0 and bm.stats().cached == 3


def test_a_fully_cached_prompt_leaves_its_last_block_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    p = _ids(12)
    bm.admit("a", p)
    bm.allocate("a", 12)
    bm.commit("a", p, 12)
    bm.free("a")
    # 12 tokens cached, but the last token's logits are needed: 2 blocks reused, not 3
    assert bm.admit("b", p) == 8


def test_the_hash_chain_names_the_whole_prefix():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _ids(4, 0) + _ids(4, 50) + [9]
    bm.admit("a", a)
    bm.allocate("a", len(a))
    bm.commit("a", a, len(a))
    b = _ids(4, 10) + _ids(4, 50) + [9]  # the same second block after another first
    assert bm.admit("b", b) == 0


def test_freed_cached_blocks_are_evicted_only_when_the_free_list_is_empty():
    bm = BlockManager(num_blocks=4, block_size=2)
    p = [5, 6, 7, 8, 1]
    bm.admit("a", p)
    bm.allocate("a", 5)
    bm.commit("a", p, 5)
    bm.free("a")  # 2 cached blocks wait; 2 free ones (the third of a's, and one never used)
    bm.admit("x", [0])
    bm.allocate("x", 4)  # takes the 2 free blocks only
    assert bm.cached_prefix(p) != []
    bm.free("x")
    bm.admit("y", [0])
    bm.allocate("y", 8)  # needs all 4: the cached blocks are evicted
    assert bm.cached_prefix(p) == [] and bm.stats().cached == 0
    bm.free("y")
    assert bm.stats().free == 4


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(num_blocks=10, block_size=2, prefix_caching=False)
    p = _ids(7)
    bm.admit("a", p)
    bm.allocate("a", 7)
    bm.commit("a", p, 7)
    assert bm.admit("b", p) == 0 and bm.stats().hit_rate == 0.0


def test_utilisation_is_the_share_of_slots_holding_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", 5)  # 2 blocks, 5 of 8 slots
    bm.allocate("b", 8)  # 2 blocks, full
    assert bm.stats().utilisation == pytest.approx(13 / 16)


def test_errors_are_one_sentence():
    with pytest.raises(OpswapError, match=r"at least one block of at least one slot, got 0"):
        BlockManager(0, 4)
    bm = BlockManager(4, 4)
    bm.admit("a", [1])
    with pytest.raises(BlockError, match="already holds blocks"):
        bm.admit("a", [1])
