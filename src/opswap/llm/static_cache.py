"""A KV cache allocated once for the longest sequence, written in place.

    cache = StaticKVCache(layers=22, batch=1, kv_heads=4, max_len=160, head_dim=64,
                          device="cuda", dtype=torch.bfloat16)
    cache.write(layer, k, v, positions)      # k, v [B, H_kv, T, D] at positions [B, T]
    cache.lengths                            # int32 [B]: valid keys per sequence

Every layer's keys and values live in [B, H_kv, S_max, D] tensors whose addresses never
change, and the valid length per sequence is a device tensor (`lengths`), not a Python
int. A decode step therefore reads and writes the same memory at every step and takes
its position from `lengths` on the device: the step has no size or int that changes, so
one CUDA graph (or one torch.compile graph) serves every step. A dynamic cache, growing
by `torch.cat`, re-allocates and copies the whole cache per token and changes shape, so
neither can hold across steps.

Writes are a `scatter_` along the sequence axis at positions given as a tensor (each
sequence may sit at its own position); `advance` adds to `lengths` in place.
"""

from __future__ import annotations

import torch

from opswap.errors import OpswapError


class DecodeError(OpswapError, ValueError):
    """An input or model that the static-cache decoder cannot take."""


class StaticKVCache:
    """k[layer], v[layer]: [batch, kv_heads, max_len, head_dim]; lengths: int32 [batch]."""

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if min(layers, batch, kv_heads, max_len, head_dim) < 1:
            raise DecodeError(
                f"a cache of {layers} layers, batch {batch}, {kv_heads} kv heads, length "
                f"{max_len} and head dim {head_dim} is empty; give each a size of at least 1."
            )
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.lengths = torch.zeros(batch, device=device, dtype=torch.int32)
        self.batch, self.max_len = batch, max_len

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values of every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def positions(self, n: int) -> torch.Tensor:
        """int64 [B, n]: the cache slots of the next n tokens of every sequence."""
        steps = torch.arange(n, device=self.lengths.device, dtype=torch.int64)
        return self.lengths.to(torch.int64)[:, None] + steps[None, :]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [B, H_kv, T, D] of `layer` at `positions` (int64 [B, T]), in place."""
        index = positions[:, None, :, None].expand(k.shape)
        self.k[layer].scatter_(2, index, k.to(self.k[layer].dtype))
        self.v[layer].scatter_(2, index, v.to(self.v[layer].dtype))

    def advance(self, n: int) -> None:
        """Count n more valid keys in every sequence (in place: a captured graph replays it)."""
        self.lengths.add_(n)

    def reset(self) -> None:
        """Forget every sequence (the memory stays; later writes overwrite it)."""
        self.lengths.zero_()
