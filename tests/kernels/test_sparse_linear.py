"""opswap::sparse_linear against the dense product of the same weight: CSR and BSR, odd
shapes, with the fake implementation's shape; torch.export keeps the op as one node."""

from __future__ import annotations

import pytest
import torch

from opswap.kernels import sparse_linear as sl
from opswap.rules.sparsity._masks import magnitude_mask


def _parts(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = w.to_sparse_csr() if block == 1 else w.to_sparse_bsr((block, block))
    return s.crow_indices().clone(), s.col_indices().clone(), s.values().clone()


@pytest.mark.parametrize(
    ("m", "k", "n", "block"), [(1, 37, 23, 1), (5, 123, 77, 1), (9, 64, 48, 16), (3, 32, 96, 32)]
)
def test_the_op_equals_the_dense_product(m: int, k: int, n: int, block: int) -> None:
    torch.manual_seed(m + k + n)
    w = torch.randn(n, k)
    w = w * magnitude_mask(w, 0.9, block)
    x, b = torch.randn(m, k), torch.randn(n)
    crow, col, values = _parts(w, block)
    got = torch.ops.opswap.sparse_linear(x, crow, col, values, b, n)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sl.reference(x, crow, col, values, b, n), got, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()


def test_export_keeps_the_op() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 24)
    crow, col, values = _parts(w * magnitude_mask(w, 0.95), 1)
    b = torch.randn(40)

    class Layer(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.opswap.sparse_linear(x, crow, col, values, b, 40)

    ep = torch.export.export(Layer(), (torch.randn(6, 24),))
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.opswap.sparse_linear.default in ops
    x = torch.randn(6, 24)
    torch.testing.assert_close(ep.module()(x), Layer()(x))
