"""Which weights a sparse layer keeps: 2:4 (two of every four consecutive inputs of an
output row, by magnitude) for the sparse tensor cores, and magnitude pruning per element
or per block for CSR/BSR. Masks are boolean tensors of the weight's shape; the rules and
opswap.train.finetune_sparse share them."""

from __future__ import annotations

import torch


def mask_2_4(weight: torch.Tensor) -> torch.Tensor:
    """Keep the two largest |w| of every four consecutive entries along the last dim (the
    input features of a Linear's [out, in] weight); the last dim must be a multiple of 4."""
    if weight.shape[-1] % 4:
        raise ValueError(f"2:4 needs the last dim to be a multiple of 4, got {weight.shape[-1]}")
    groups = weight.detach().abs().float().reshape(-1, 4)
    top = groups.topk(2, dim=1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, top, True)
    return mask.reshape(weight.shape)


def is_2_4(weight: torch.Tensor) -> bool:
    """True when at most two of every four consecutive entries of the last dim are nonzero."""
    if weight.shape[-1] % 4:
        return False
    return bool(((weight.reshape(-1, 4) != 0).sum(1) <= 2).all())


def magnitude_mask(weight: torch.Tensor, sparsity: float, block: int = 1) -> torch.Tensor:
    """Keep the (1 - sparsity) share of a 2-D weight with the largest magnitude: single
    entries (block 1, for CSR) or whole block x block tiles by their L2 norm (for BSR; the
    weight's sides must be multiples of `block`)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    rows, cols = weight.shape
    if rows % block or cols % block:
        raise ValueError(f"a {rows} x {cols} weight does not split into {block} x {block} blocks")
    w = weight.detach().float()
    scores = w.reshape(rows // block, block, cols // block, block).pow(2).sum((1, 3))
    keep = max(1, round(scores.numel() * (1.0 - sparsity)))
    flat = torch.zeros(scores.numel(), dtype=torch.bool, device=w.device)
    flat[scores.flatten().topk(keep).indices] = True
    tiles = flat.view_as(scores)
    return tiles.repeat_interleave(block, 0).repeat_interleave(block, 1)
