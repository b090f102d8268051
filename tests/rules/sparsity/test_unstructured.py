"""sparsity.unstructured: Linears pruned to 90% by magnitude and stored CSR compute what the
masked dense layer computes, at odd shapes and other batch sizes; a site is kept only
where the target's timer says the sparse layer is faster, and said why otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.rules.sparsity._masks import magnitude_mask
from opswap.rules.sparsity._modules import SparseLinear, sparse_reference
from opswap.rules.sparsity.unstructured import SPARSITY, layout

from .._shapes import assert_same_at_other_shapes
from ._helpers import count, plan_rule, timed_target, why

RULE = "sparsity.unstructured"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(37, 123)
        self.b = nn.Linear(123, 19, bias=False)
        self.head = nn.Linear(19, 5).half()  # float16 on the CPU: refused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        h.mul_(2.0)  # in place on the sparse layer's output
        return self.head(self.b(h).half()).float()


class Masked(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(sparse_reference(x, self.a.weight, self.a.bias, SPARSITY, 1)) * 2.0
        y = sparse_reference(h, self.b.weight, None, SPARSITY, 1)
        return self.head(y.half()).float()


@pytest.mark.parametrize("shape", [(3, 5, 37), (7, 37)])
def test_csr_layers_compute_the_masked_dense_layer(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(*shape)
    cap, plan, applied = plan_rule(model, (x,), RULE, timed_target("cpu", 2.0, 1.0))
    assert count(plan, RULE) == 2
    assert "float16; the sparse product on the cpu takes float32" in why(plan, RULE)
    mods = [m for m in applied.gm.modules() if isinstance(m, SparseLinear)]
    assert [m.sparse_weight().layout for m in mods] == [torch.sparse_csr] * 2
    assert all(m.values.numel() == round(0.1 * m.in_features * m.out_features) for m in mods)
    expected = Masked().eval()
    expected.load_state_dict(model.state_dict())
    y = torch.randn(*shape)
    torch.testing.assert_close(applied.gm(y), expected(y), rtol=1e-3, atol=1e-3)
    assert_same_at_other_shapes(expected, cap, applied.gm, rel=1e-3)


def test_kept_only_where_measured_faster() -> None:
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 37)
    _, plan, _ = plan_rule(model, (x,), RULE, timed_target("cpu", 1.0, 1.5))
    assert count(plan, RULE) == 0
    assert "sparse 1500000.0 us (0.67x)" in why(plan, RULE)
    _, plan, _ = plan_rule(model, (x,), RULE)  # the default CPU target: no timer here
    assert count(plan, RULE) == 0 and "needs a measurement on the target" in why(plan, RULE)


def test_magnitude_masks_keep_the_largest_entries_and_blocks() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 80)
    m = magnitude_mask(w, 0.9)
    assert int(m.sum()) == 384
    assert w[m].abs().min() >= w[~m].abs().max()
    b = magnitude_mask(w, 0.95, block=16)
    tiles = b.reshape(3, 16, 5, 16).any(3).any(1)
    assert int(tiles.sum()) == 1 and int(b.sum()) == 256  # round(15 * 0.05) = 1 tile
    with pytest.raises(ValueError, match="16 x 16 blocks"):
        magnitude_mask(torch.randn(20, 32), 0.9, block=16)
    assert layout(torch.device("cpu"), 20, 33) == 1
    assert "not a multiple of 16 x 16" in str(layout(torch.device("cuda"), 20, 32))


def test_sparse_layer_module_copies_and_runs_at_high_sparsity() -> None:
    torch.manual_seed(1)
    w, b = torch.randn(21, 45), torch.randn(21)
    for sparsity in (0.9, 0.95, 0.99):
        layer = SparseLinear(w, b, sparsity)
        x = torch.randn(2, 3, 45)
        want = sparse_reference(x, w, b, sparsity, 1)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(copy.deepcopy(layer)(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="BSR on the GPU: run by the GPU suite")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bsr_layer_on_the_gpu_matches_the_masked_dense_layer(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w, b = (
        torch.randn(96, 160, device="cuda", dtype=dtype),
        torch.randn(96, device="cuda", dtype=dtype),
    )
    layer = SparseLinear(w, b, 0.9, block=32)
    x = torch.randn(5, 33, 160, device="cuda", dtype=dtype)
    want = sparse_reference(x.float(), w.float(), b.float(), 0.9, 32)
    torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=2e-2)


def test_the_rewritten_model_exports_with_dynamic_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 44), nn.ReLU(), nn.Linear(44, 6)).eval()
    x = torch.randn(5, 20)
    _, plan, applied = plan_rule(model, (x,), RULE, timed_target("cpu", 2.0, 1.0))
    assert count(plan, RULE) == 2
    batch = torch.export.Dim("batch", min=1)
    ep = torch.export.export(applied.gm, (x,), dynamic_shapes=({0: batch},))
    y = torch.randn(9, 20)
    torch.testing.assert_close(ep.module()(y), applied.gm(y))
