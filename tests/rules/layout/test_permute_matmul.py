"""layout.permute_matmul: constant transposes feeding a matmul, dropped contiguous copies,
and the stride test it relies on, checked against torch.matmul.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from opswap.graph import op_kind
from opswap.rules._matching import matmul_reads_in_place

from ._helpers import FLAVOURS, SHAPE, keys, run


class Matmuls(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(11, 13))
        self.w2 = nn.Parameter(torch.randn(11, 13))
        self.w3 = nn.Parameter(torch.randn(5, 11, 13))

    def forward(self, x):
        y = x @ self.w.t()  # -> linear
        z = torch.matmul(x, self.w2.transpose(0, 1))  # -> linear
        u = torch.matmul(x, self.w3.transpose(1, 2))  # batched constant: stored permuted
        v = torch.matmul(x.transpose(2, 3).contiguous(), x)  # contiguous dropped
        w = torch.matmul(x.transpose(1, 2).contiguous(), x[0, 0].t())  # matmul would copy
        return y, z, u, v, w


@pytest.mark.parametrize("method", FLAVOURS)
def test_permute_matmul(method):
    plan, applied = run(Matmuls(), "layout.permute_matmul", method)
    assert keys(plan) == [
        "linear:matmul",
        "linear:matmul_1",
        "pretranspose:transpose_1",
        "contiguous:contiguous",
    ]
    assert len(plan.misses) == 1 and plan.misses[0].where == "contiguous_1"
    assert "torch.matmul would copy transpose_3 itself" in plan.misses[0].reason
    gm = applied.gm
    kinds = [op_kind(n) for n in gm.graph.nodes]
    assert kinds.count("linear") == 2 and kinds.count("contiguous") == 1
    assert not hasattr(gm, "w3") and gm.w3_permuted.is_contiguous()
    # the dropped copy saves writing and re-reading x^T: 2 x 4 bytes x numel
    saved = {d.site.key: d.estimate.bytes_saved for d in plan.decisions}
    assert saved["contiguous:contiguous"] == 2 * 4 * torch.Size(SHAPE).numel()


def _matmul_copies(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.profiler import profile

    with profile() as prof:
        torch.matmul(a, b)
    return any(e.name in ("aten::copy_", "aten::clone", "aten::contiguous") for e in prof.events())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.integers(2, 11), min_size=2, max_size=4), st.data())
def test_matmul_reads_in_place_agrees_with_torch(shape, data):
    """The rule's model of torch.matmul: an operand it says can be read in place is never
    copied by matmul; one it says cannot is copied once the matrices are large enough for
    BLAS (CPU bmm multiplies tiny matrices with a plain loop that takes any strides)."""
    perm = data.draw(st.permutations(range(len(shape))))
    a = torch.randn(shape).permute(*perm)
    b = torch.randn(*a.shape[:-2], a.shape[-1], 9)
    copies = _matmul_copies(a, b)
    if matmul_reads_in_place(a.shape, a.stride()):
        assert not copies
    elif a.shape[-2] * a.shape[-1] * 9 >= 400:
        assert copies
