"""A Linear whose weight is stored compressed-sparse (CSR, or BSR in square blocks), as
the op `opswap::sparse_linear`, so that torch.export and torch.compile keep the layer as
one node (a sparse tensor built inside a traced forward does not survive fake tensors).

    y[M, N] = x[M, K] @ W^T + b,   W [N, K] given by (crow, col, values)

The product is torch.sparse's: `W @ x^T` with W sparse (MKL's or PyTorch's CSR kernel on
the CPU; on a GPU, BSR through Triton's `bsr_dense_mm` where it imports, else cuSPARSE),
then transposed back. It reads nnz values and their indices instead of N x K values:
at 90% zeros a tenth of the weight, at 99% a hundredth. Whether that beats a dense GEMM
depends on the shape, the machine and the thread count (the indexed gather runs far below
a dense kernel's rate), so opswap's rule times each site (rules/sparsity/unstructured.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


def _bsr_mm() -> Any:
    """torch.sparse._triton_ops.bsr_dense_mm where Triton imports, else None."""
    try:
        from torch.sparse._triton_ops import bsr_dense_mm
    except Exception:  # noqa: BLE001 - no Triton: the plain sparse product
        return None
    return bsr_dense_mm


def sparse_weight(
    crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """W [n, k] as a sparse tensor over these parts: CSR for 1-D values, BSR for blocks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        if values.dim() == 1:
            return torch.sparse_csr_tensor(crow, col, values, (n, k))
        return torch.sparse_bsr_tensor(crow, col, values, (n, k))


def reference(
    x: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
    bias: torch.Tensor, n: int,
) -> torch.Tensor:  # fmt: skip
    """The same product with the weight made dense again (for tests)."""
    w = sparse_weight(crow, col, values, n, x.shape[-1]).to_dense()
    return torch.nn.functional.linear(x, w, bias)


@torch.library.custom_op("opswap::sparse_linear", mutates_args=())
def sparse_linear(
    x: torch.Tensor,
    crow: torch.Tensor,
    col: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    out_features: int,
) -> torch.Tensor:
    """x [M, K] @ W^T + bias [N], W [N, K] sparse (CSR, or BSR for 3-D values)."""
    w = sparse_weight(crow, col, values, out_features, x.shape[-1])
    rows = x.t()  # [K, M]
    mm = _bsr_mm() if values.dim() == 3 and x.is_cuda else None
    if mm is not None:
        y = mm(w, rows.contiguous()) + bias[:, None]
    else:
        y = torch.addmm(bias[:, None], w, rows)  # [N, M]
    return y.t().contiguous()


@sparse_linear.register_fake
def _fake(
    x: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
    bias: torch.Tensor, out_features: int,
) -> torch.Tensor:  # fmt: skip
    return x.new_empty((x.shape[0], out_features))
