"""kernels._triton_op: opswap's ops are registered at import without torch's source search
for their Triton kernels, and the search runs, with torch's own answer, when asked."""

from __future__ import annotations

import pytest
import torch

import opswap.kernels  # noqa: F401  (registers the ops)
from opswap.kernels import _triton_op

lib = getattr(torch._library, "triton", None)
needs_search = pytest.mark.skipif(
    getattr(lib, "get_inner_triton_kernels", None) is None,
    reason="this torch does not search a triton_op for its kernels",
)


@needs_search
@pytest.mark.parametrize("op", ["rms_norm", "softmax", "flash_attention", "glu_packed"])
def test_the_kernels_are_found_when_first_asked(op):
    found = lib.get_triton_kernels_for_op(f"opswap::{op}")
    assert isinstance(found, _triton_op._Found)
    assert not found._done  # nothing searched at import
    want = lib.get_inner_triton_kernels(found._fn)  # torch's search, now
    assert list(found) == want and len(found) == len(want) and found._done


@needs_search
def test_the_search_is_put_back_after_registering():
    from opswap.kernels._triton_op import triton_op

    before = lib.get_inner_triton_kernels

    @triton_op("opswap_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert lib.get_inner_triton_kernels is before
    assert isinstance(lib.get_triton_kernels_for_op("opswap_test::twice"), _triton_op._Found)
    assert list(lib.get_triton_kernels_for_op("opswap_test::twice")) == []
    assert torch.equal(torch.ops.opswap_test.twice(torch.ones(3)), torch.full((3,), 2.0))
