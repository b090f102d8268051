"""The paged KV cache's bookkeeping (chapter 29): which block of the pool holds which
sequence's tokens, and which full blocks can be shared between prompts.

    bm = BlockManager(num_blocks=64, block_size=16)
    cached = bm.admit("a", prompt_ids)            # tokens found in the prefix cache
    bm.allocate("a", len(prompt_ids))              # blocks for the first n tokens
    bm.table("a")                                  # block ids, in token order
    bm.commit("a", prompt_ids, len(prompt_ids))    # full blocks become shareable
    bm.free("a")

Every block has a reference count: the sequences whose table lists it. Free blocks sit
on a free list. With prefix caching on, a full block is named by a hash chain,
hash(parent block's hash, its token ids), so one hash names the whole prefix up to that
block; a table maps hashes to blocks. A new prompt walks its full blocks' hashes and
takes the cached blocks of its longest cached prefix (each reference count + 1) instead
of computing them again. A block whose count drops to zero keeps its KV and its hash: it
waits on an LRU list and is handed out as a new block only when the free list is empty
(and then leaves the hash table).

Only full blocks are ever shared, and a full block is never written again (a sequence's
next token goes to a fresh block), so shared blocks need no copy-on-write. Everything
here is O(blocks touched) per call, without scanning the pool.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from opswap.errors import OpswapError


class BlockError(OpswapError, ValueError):
    """A request that the block manager cannot serve."""


@dataclass
class BlockStats:
    """A snapshot of the pool.

    `in_use`: blocks some sequence holds; `cached`: blocks whose KV is named in the prefix
    cache (in use or waiting to be evicted); `hit_rate`: share of the full prompt blocks
    looked up that were found cached; `utilisation`: share of the slots in the sequences'
    blocks that hold a token (a shared block counted once per sequence).
    """

    num_blocks: int
    in_use: int
    free: int
    cached: int
    queried_blocks: int
    hit_blocks: int
    hit_rate: float
    utilisation: float


class BlockManager:
    """A pool of `num_blocks` blocks of `block_size` token slots, handed to sequences."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise BlockError(
                f"a block pool needs at least one block of at least one slot, got "
                f"{num_blocks} blocks of {block_size}."
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._key: list[tuple[int | None, tuple[int, ...]] | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0, hashed: LRU first
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}  # hashes of the sequence's committed blocks
        self._tokens: dict[str, int] = {}  # slots allocated per sequence
        self._in_use = 0
        self.queried_blocks = 0
        self.hit_blocks = 0

    # -- queries -------------------------------------------------------------------------

    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached and unreferenced)."""
        return len(self._free) + len(self._evictable)

    def table(self, seq: str) -> list[int]:
        return self._tables[seq]

    def blocks_needed(self, seq: str, num_tokens: int) -> int:
        """New blocks the sequence needs to hold `num_tokens` tokens in all."""
        have = len(self._tables.get(seq, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, seq: str, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free()

    def _chain(self, parent: int | None, ids: Sequence[int]) -> tuple[int, tuple]:
        key = (parent, tuple(ids))
        return hash(key), key

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of token_ids, in full blocks, leaving at
        least the last token to compute (its logits are needed)."""
        if not self.prefix_caching:
            return []
        bs, parent, found = self.block_size, None, []
        for i in range((len(token_ids) - 1) // bs):
            h, key = self._chain(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(h)
            if block is None or self._key[block] != key:
                break
            found.append(block)
            parent = h
        return found

    def fits_new(self, prefix: list[int], num_tokens: int) -> bool:
        """Whether a new sequence starting on the cached blocks `prefix` can get blocks for
        num_tokens more tokens (the cached blocks it takes stop being evictable)."""
        cached = len(prefix) * self.block_size
        need = -(-(cached + num_tokens) // self.block_size) - len(prefix)
        taken = sum(1 for b in prefix if b in self._evictable)
        return need <= self.num_free() - taken

    def stats(self) -> BlockStats:
        slots = sum(len(t) for t in self._tables.values()) * self.block_size
        held = sum(self._tokens.values())
        q = self.queried_blocks
        return BlockStats(
            num_blocks=self.num_blocks,
            in_use=self._in_use,
            free=self.num_free(),
            cached=len(self._cached),
            queried_blocks=q,
            hit_blocks=self.hit_blocks,
            hit_rate=self.hit_blocks / q if q else 0.0,
            utilisation=held / slots if slots else 1.0,
        )

    # -- changes -------------------------------------------------------------------------

    def admit(self, seq: str, token_ids: Sequence[int], prefix: list[int] | None = None) -> int:
        """Start a sequence on the cached blocks of its prompt's longest cached prefix
        (`prefix`, when already looked up); returns the number of tokens they hold."""
        if seq in self._tables:
            raise BlockError(f"sequence {seq!r} already holds blocks; free it first.")
        if prefix is None:
            prefix = self.cached_prefix(token_ids)
        self.queried_blocks += (len(token_ids) - 1) // self.block_size if self.prefix_caching else 0
        self.hit_blocks += len(prefix)
        for b in prefix:
            self._take(b)
        self._tables[seq] = list(prefix)
        self._hashes[seq] = [self._hash[b] for b in prefix]  # type: ignore[misc]
        self._tokens[seq] = len(prefix) * self.block_size
        return self._tokens[seq]

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            self._evictable.pop(block, None)
            self._in_use += 1
        self._ref[block] += 1

    def _new_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            if h is not None and self._cached.get(h) == block:
                del self._cached[h]
            self._hash[block] = self._key[block] = None
        self._ref[block] = 1
        self._in_use += 1
        return block

    def allocate(self, seq: str, num_tokens: int) -> list[int]:
        """Grow the sequence's table to hold num_tokens tokens in all; returns the table.
        Raises BlockError when the pool is short (check `can_allocate` first)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free():
            raise BlockError(
                f"sequence {seq!r} needs {need} more KV blocks but {self.num_free()} are free."
            )
        table = self._tables.setdefault(seq, [])
        self._hashes.setdefault(seq, [])
        for _ in range(need):
            table.append(self._new_block())
        self._tokens[seq] = max(self._tokens.get(seq, 0), num_tokens)
        return table

    def truncate(self, seq: str, num_tokens: int) -> None:
        """Shrink the sequence to its first num_tokens tokens: the blocks past them go back
        (speculative drafts that were rejected). Only unnamed blocks can be past them,
        since a block is named once its tokens are final."""
        table = self._tables[seq]
        keep = -(-num_tokens // self.block_size)
        hashes = self._hashes[seq]
        if len(hashes) > keep:
            raise BlockError(
                f"sequence {seq!r} cannot drop tokens of its blocks already in the prefix cache."
            )
        for block in reversed(table[keep:]):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._in_use -= 1
                self._free.append(block)
        del table[keep:]
        self._tokens[seq] = min(self._tokens.get(seq, 0), num_tokens)

    def num_committed(self, seq: str) -> int:
        """The sequence's full blocks already named in the prefix cache."""
        return len(self._hashes[seq]) if self.prefix_caching else self.num_blocks

    def commit(self, seq: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """The KV of the sequence's first num_tokens tokens (of token_ids) is written, or
        will be before anything reads it: name its newly full blocks in the prefix cache."""
        if not self.prefix_caching:
            return
        bs, table, hashes = self.block_size, self._tables[seq], self._hashes[seq]
        full = min(num_tokens // bs, len(table))
        for i in range(len(hashes), full):
            parent = hashes[-1] if hashes else None
            h, key = self._chain(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            block = table[i]
            if h not in self._cached:  # the first block computed for a prefix is the one shared
                self._cached[h] = block
                self._hash[block], self._key[block] = h, key

    def free(self, seq: str) -> None:
        """Release the sequence's blocks; cached ones stay reusable until evicted."""
        table = self._tables.pop(seq, [])
        self._hashes.pop(seq, None)
        self._tokens.pop(seq, None)
        # the tail first, so that the LRU list evicts a prefix's last blocks before its first
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._in_use -= 1
                if self._hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
