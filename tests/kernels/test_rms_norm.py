"""opswap::rms_norm and opswap::add_rms_norm: the Triton kernels (under TRITON_INTERPRET=1
in one child Python) forward and backward against float64 on odd shapes in fp32 and
bf16, both HF forms (cast then weight; weight then cast with Gemma's 1 + weight), the
add form's sum bit-equal to eager's add; the CPU op, opcheck and torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import rms_norm as R  # noqa: E402

FORMS = [(True, 0.0), (False, 1.0)]  # (cast_first, offset): Llama's, Gemma's


def _case(shape, dtype, cast_first, offset, residual):
    g = torch.Generator().manual_seed(sum(shape) + cast_first)
    x = torch.randn(shape, generator=g).to(rc.DEVICE, dtype).requires_grad_()
    r = torch.randn(shape, generator=g).to(rc.DEVICE, dtype).requires_grad_() if residual else None
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(rc.DEVICE, dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(rc.DEVICE, dtype)
    if residual:
        y, s = R.add_rms_norm(x, r, w, 1e-6, offset, cast_first)
    else:
        y, s = R.rms_norm(x, w, 1e-6, offset, cast_first), x
    y.backward(dy)
    leaves = [x, w] + ([r] if residual else [])
    got = [t.grad for t in leaves]
    # float64 truth, and PyTorch's own computation in the dtype (the yardstick)
    d = [t.detach().double().requires_grad_() for t in leaves]
    yd = R.reference(d[0], d[1], 1e-6, offset, cast_first, d[2] if residual else None)[0]
    yd.backward(dy.double())
    e = [t.detach().clone().requires_grad_() for t in leaves]
    ye = R.reference(e[0], e[1], 1e-6, offset, cast_first, e[2] if residual else None)[0]
    ye.backward(dy)
    return {
        "dtype": str(y.dtype),
        "shape": list(y.shape),
        "y": rc.rel(y, yd),
        "y_torch": rc.rel(ye, yd),
        "grads": [rc.rel(a, b.grad) for a, b in zip(got, d, strict=True)],
        "grads_torch": [rc.rel(a.grad, b.grad) for a, b in zip(e, d, strict=True)],
        "sum_equal": bool(torch.equal(s, x + r)) if residual else True,
    }


# every shape and dtype in Llama's form; Gemma's form and the add form on two of them
CASES = [(shape, dtype, True, 0.0, False) for shape in rc.SHAPES for dtype in rc.DTYPES] + [
    ((3, 7, 4097), torch.bfloat16, False, 1.0, False),
    ((5, 123), torch.float32, False, 1.0, False),
    ((5, 123), torch.float32, True, 0.0, True),
    ((3, 7, 4097), torch.bfloat16, True, 0.0, True),
    ((1, 16383), torch.bfloat16, False, 1.0, True),
]


def _key(c):
    return str([list(c[0]), str(c[1]), c[2], c[3], c[4]])


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_float64(interpreted, case):
    shape, dtype = case[0], case[1]
    r = interpreted[_key(case)]
    assert r["shape"] == list(shape) and r["dtype"] == str(dtype)
    assert r["y"] <= rc.bound(dtype, r["y_torch"]), r
    for got, own in zip(r["grads"], r["grads_torch"], strict=True):
        assert got <= rc.bound(dtype, own), r
    assert r["sum_equal"], "the add form's sum differs from eager's add"


@pytest.mark.parametrize("cast_first", [True, False])
def test_cpu_op_is_the_reference_and_keeps_the_dtypes(cast_first):
    x = torch.randn(4, 9, 48).bfloat16()
    w32 = torch.rand(48) + 0.5  # an fp32 weight on bf16 x: Llama's form promotes
    y = R.rms_norm(x, w32, 1e-5, 0.0, cast_first)
    assert y.dtype == (torch.float32 if cast_first else torch.bfloat16)
    assert torch.equal(y, R.reference(x, w32, 1e-5, 0.0, cast_first)[0])
    assert R.rms_norm(x, None, 1e-5, 0.0, cast_first).dtype == torch.bfloat16


def test_nn_rms_norm_is_the_weight_then_cast_form():
    x, m = torch.randn(6, 40).bfloat16(), torch.nn.RMSNorm(40, eps=1e-6).bfloat16()
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        assert torch.equal(m(x), R.rms_norm(x, m.weight, 1e-6, 0.0, False))


def test_opcheck_and_export_keep_the_ops():
    x, r, w = torch.randn(3, 5, 32), torch.randn(3, 5, 32), torch.rand(32) + 0.5
    torch.library.opcheck(R.rms_norm, (x.requires_grad_(), w, 1e-6, 0.0, True))
    torch.library.opcheck(R.add_rms_norm, (x, r, w, 1e-6, 1.0, False))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(32) + 0.5)

        def forward(self, x, r):
            y, s = R.add_rms_norm(x, r, self.w, 1e-6, 0.0, True)
            return R.rms_norm(y, None, 1e-6, 0.0, True) + s

    ep = torch.export.export(Block(), (x.detach(), r))
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert {torch.ops.opswap.add_rms_norm.default, torch.ops.opswap.rms_norm.default} <= ops


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
