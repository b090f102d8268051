"""opswap::row_reduce and opswap::row_dot: the Triton block reductions (under
TRITON_INTERPRET=1 in one child Python) against float64 on odd shapes in fp32 and bf16:
sum, mean, max, var (unbiased and not, on data with a large mean, where E[x^2] - E[x]^2
would cancel), sum and mean of squares, sum of a product; the backward of each; the CPU
op, opcheck and torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import reduction as R  # noqa: E402

SHAPES = [(5, 123), (1, 16383), (3, 7, 4097)]
CASES = [
    (s, d, op, ub)
    for s in SHAPES
    for d in (torch.float32, torch.bfloat16)
    for op, ub in [*((o, True) for o in R.OPS), ("var", False), ("dot", True)]
    if d == torch.float32 or s != (1, 16383)  # bf16 on two shapes: the interpreter is slow
]


def _key(c):
    return str([list(c[0]), str(c[1]), c[2], c[3]])


def _torch_op(x, y, op, ub):
    """PyTorch's own computation in the dtype (the yardstick)."""
    if op == "dot":
        return (x * y).sum(-1)
    if op == "sumsq":
        return x.pow(2).sum(-1)
    if op == "meansq":
        return x.pow(2).mean(-1)
    if op == "var":
        return x.var(-1, correction=int(ub))
    return getattr(x, "amax" if op == "max" else op)(-1)


def _case(shape, dtype, op, ub):
    g = torch.Generator().manual_seed(sum(shape) + len(op))
    x = (torch.randn(shape, generator=g) + (100.0 if op == "var" else 0.0)).to(rc.DEVICE, dtype)
    y = torch.randn(shape, generator=g).to(rc.DEVICE, dtype)
    dy = torch.randn(shape[:-1], generator=g).to(rc.DEVICE, dtype)
    leaves = [x.clone().requires_grad_()] + ([y.clone().requires_grad_()] if op == "dot" else [])
    if op == "dot":
        out = R.row_dot(leaves[0], leaves[1], False)
    else:
        out = R.row_reduce(leaves[0], op, ub, False)
    out.backward(dy)
    d = [t.detach().double().requires_grad_() for t in leaves]
    e = [t.detach().clone().requires_grad_() for t in leaves]
    yd = _torch_op(d[0], d[1] if op == "dot" else None, op, ub)
    yd.backward(dy.double())
    ye = _torch_op(e[0], e[1] if op == "dot" else None, op, ub)
    ye.backward(dy)
    return {
        "dtype": str(out.dtype),
        "shape": list(out.shape),
        "y": rc.rel(out, yd),
        "y_torch": rc.rel(ye, yd),
        "grads": [rc.rel(a.grad, b.grad) for a, b in zip(leaves, d, strict=True)],
        "grads_torch": [rc.rel(a.grad, b.grad) for a, b in zip(e, d, strict=True)],
    }


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_float64(interpreted, case):
    shape, dtype = case[0], case[1]
    r = interpreted[_key(case)]
    assert r["shape"] == list(shape[:-1]) and r["dtype"] == str(dtype)
    assert r["y"] <= rc.bound(dtype, r["y_torch"]), r
    for got, own in zip(r["grads"], r["grads_torch"], strict=True):
        assert got <= rc.bound(dtype, own), r


def test_cpu_op_is_the_reference_and_keepdim_keeps_the_dim():
    x = torch.randn(4, 9, 33).bfloat16()
    assert torch.equal(R.row_reduce(x, "sumsq", True, True), R.reference(x, "sumsq", True, True))
    assert R.row_reduce(x, "var", False, True).shape == (4, 9, 1)
    assert R.row_dot(x, x, False).dtype == torch.bfloat16
    with pytest.raises(R.KernelError, match="not one of"):
        R.row_reduce(x, "median", True, False)


def test_opcheck_and_export_keep_the_ops():
    x = torch.randn(3, 5, 40, requires_grad=True)
    for op in R.OPS:
        torch.library.opcheck(R.row_reduce, (x, op, op != "var", op == "max"))
    torch.library.opcheck(R.row_dot, (x, torch.randn(3, 5, 40, requires_grad=True), True))

    class Energy(torch.nn.Module):
        def forward(self, a, b):
            return R.row_reduce(a, "meansq", True, True) * R.row_dot(a, b, True)

    ep = torch.export.export(Energy(), (x.detach(), x.detach() + 1))
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert {torch.ops.opswap.row_reduce.default, torch.ops.opswap.row_dot.default} <= ops


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
