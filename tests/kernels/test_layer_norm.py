"""opswap::layer_norm: the Triton kernels (under TRITON_INTERPRET=1 in one child Python)
forward and backward (dx, dw, db) against float64 on odd shapes in fp32 and bf16, with and
without the affine; the CPU op against F.layer_norm; opcheck and torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import layer_norm as L  # noqa: E402


def _case(shape, dtype, affine):
    g = torch.Generator().manual_seed(sum(shape) + affine)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(rc.DEVICE, dtype).requires_grad_()
    w = (
        (torch.rand(shape[-1], generator=g) + 0.5).to(rc.DEVICE, dtype).requires_grad_()
        if affine
        else None
    )
    b = (
        torch.randn(shape[-1], generator=g).to(rc.DEVICE, dtype).requires_grad_()
        if affine
        else None
    )
    dy = torch.randn(shape, generator=g).to(rc.DEVICE, dtype)
    y = L.layer_norm(x, w, b, 1e-5)
    y.backward(dy)
    leaves = [t for t in (x, w, b) if t is not None]
    d = [t.detach().double().requires_grad_() for t in leaves]
    e = [t.detach().clone().requires_grad_() for t in leaves]
    n = shape[-1]
    yd = F.layer_norm(d[0], (n,), *(d[1:] if affine else (None, None)), 1e-5)
    yd.backward(dy.double())
    ye = F.layer_norm(e[0], (n,), *(e[1:] if affine else (None, None)), 1e-5)
    ye.backward(dy)
    return {
        "dtype": str(y.dtype),
        "shape": list(y.shape),
        "y": rc.rel(y, yd),
        "y_torch": rc.rel(ye, yd),
        "grads": [rc.rel(a.grad, b.grad) for a, b in zip(leaves, d, strict=True)],
        "grads_torch": [rc.rel(a.grad, b.grad) for a, b in zip(e, d, strict=True)],
    }


CASES = [(s, dt, True) for s in rc.SHAPES for dt in rc.DTYPES if s != (1, 16383)] + [
    ((1, 16383), torch.bfloat16, True),
    ((5, 123), torch.float32, False),
]


def _key(c):
    return str([list(c[0]), str(c[1]), c[2]])


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_float64(interpreted, case):
    r = interpreted[_key(case)]
    assert r["shape"] == list(case[0]) and r["dtype"] == str(case[1])
    assert r["y"] <= rc.bound(case[1], r["y_torch"]), r
    for got, own in zip(r["grads"], r["grads_torch"], strict=True):
        assert got <= rc.bound(case[1], own), r


def test_cpu_op_is_f_layer_norm_and_export_keeps_it():
    x, w, b = (
        torch.randn(2, 3, 40).bfloat16(),
        torch.rand(40).bfloat16(),
        torch.randn(40).bfloat16(),
    )
    assert torch.equal(L.layer_norm(x, w, b, 1e-6), F.layer_norm(x, (40,), w, b, 1e-6))
    torch.library.opcheck(L.layer_norm, (x.float().requires_grad_(), w.float(), None, 1e-5))
    ln = torch.nn.LayerNorm(40)

    class M(torch.nn.Module):
        def forward(self, x):
            return L.layer_norm(x, ln.weight, ln.bias, 1e-5) * 2

    ep = torch.export.export(M(), (torch.randn(3, 40),))
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.opswap.layer_norm.default in ops


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
