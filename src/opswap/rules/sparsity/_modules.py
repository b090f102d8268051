"""The layers the sparsity rules install, each beside the dense computation it stands for.

`SemiSparseLinear`: a Linear whose weight is 2:4 sparse and held compressed (half the
values plus 2-bit indices) by `torch.sparse.to_sparse_semi_structured`'s tensor subclass;
`F.linear` on it runs cuSPARSELt's or CUTLASS's sparse tensor-core GEMM. CUDA only.

`SparseLinear`: a Linear whose weight is mostly zeros, stored as CSR (single entries) or
BSR (square blocks): the product reads only the stored entries. On the CPU it is one
`torch.addmm` of the sparse weight with the transposed input; on a GPU a BSR weight goes
through the Triton kernels of `torch.sparse._triton_ops` where they import; both as the op
`opswap::sparse_linear` (kernels/sparse_linear.py), which torch.export keeps.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opswap.kernels import sparse_linear as sl
from opswap.rules.sparsity._masks import magnitude_mask, mask_2_4

BACKENDS = ("cusparselt", "cutlass")


def semi_structured_backend() -> str:
    """The backend `to_sparse_semi_structured` picks here: CUTLASS where the user set
    `SparseSemiStructuredTensor._FORCE_CUTLASS` or cuSPARSELt is missing, else cuSPARSELt."""
    from torch.sparse import SparseSemiStructuredTensor

    if SparseSemiStructuredTensor._FORCE_CUTLASS:
        return "cutlass"
    available = getattr(torch.backends, "cusparselt", None)
    return "cusparselt" if available is not None and available.is_available() else "cutlass"


def _subclass(backend: str) -> Any:
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    return (
        SparseSemiStructuredTensorCUTLASS
        if backend == "cutlass"
        else SparseSemiStructuredTensorCUSPARSELT
    )


def semi_structured_shape_reason(n: int, k: int, dtype: torch.dtype, backend: str) -> str | None:
    """Why a [n, k] weight of `dtype` cannot be compressed by `backend`, or None."""
    limits = _subclass(backend)._DTYPE_SHAPE_CONSTRAINTS.get(dtype)
    if limits is None:
        return f"{backend} has no 2:4 kernel for {str(dtype).removeprefix('torch.')}"
    rows, cols = limits.sparse_min_rows, limits.sparse_min_cols
    if n % rows or k % cols:
        return f"its weight is {n} x {k}; {backend}'s 2:4 kernel takes multiples of {rows} x {cols}"
    return None


class SemiSparseLinear(nn.Module):
    """y = x W^T + b, W pruned to 2:4 by magnitude and held compressed (CUDA only)."""

    opswap_kind = "sparse_linear"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown 2:4 backend {backend!r}; use {' or '.join(BACKENDS)}")
        self.out_features, self.in_features = weight.shape
        self.backend = backend
        dense = (weight.detach() * mask_2_4(weight)).contiguous()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "prototype stage"
            packed = _subclass(backend).from_dense(dense)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, 2:4 {self.backend}"
        )


def semi_structured_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What SemiSparseLinear computes, densely: the 2:4-masked weight in a plain Linear."""
    return F.linear(x, weight * mask_2_4(weight), bias)


class SparseLinear(nn.Module):
    """y = x W^T + b with W pruned by magnitude to `sparsity` and stored as CSR (`block`
    1) or BSR (square blocks of `block`). The compressed parts are plain buffers (row
    offsets, column indices, values), so the layer copies, moves and saves like any other;
    the sparse tensor is assembled from them on each call (no copy)."""

    opswap_kind = "sparse_linear"
    crow: torch.Tensor  # buffers: [out / block + 1] row offsets, column indices, values
    col: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor  # [out, 1]: added to each column of W @ x^T

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, sparsity: float, block: int = 1
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.sparsity, self.block = sparsity, block
        w = weight.detach()
        dense = (w * magnitude_mask(w, sparsity, block)).contiguous()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
            sparse = dense.to_sparse_csr() if block == 1 else dense.to_sparse_bsr((block, block))
        self.register_buffer("crow", sparse.crow_indices().clone())
        self.register_buffer("col", sparse.col_indices().clone())
        self.register_buffer("values", sparse.values().clone())
        b = torch.zeros(self.out_features, dtype=w.dtype, device=w.device) if bias is None else bias
        self.register_buffer("bias", b.detach().clone().reshape(-1, 1))

    def sparse_weight(self) -> torch.Tensor:
        """W as a sparse CSR or BSR tensor over this layer's buffers."""
        return sl.sparse_weight(
            self.crow, self.col, self.values, self.out_features, self.in_features
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        rows = x.reshape(-1, self.in_features)
        bias = self.bias.reshape(-1)
        y = sl.sparse_linear(rows, self.crow, self.col, self.values, bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        layout = "CSR" if self.block == 1 else f"BSR {self.block}x{self.block}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{100 * self.sparsity:g}% zeros, {layout}"
        )


def sparse_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sparsity: float, block: int
) -> torch.Tensor:
    """What SparseLinear computes, densely."""
    return F.linear(x, weight * magnitude_mask(weight, sparsity, block), bias)
