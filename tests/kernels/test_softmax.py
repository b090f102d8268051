"""opswap::softmax, log_softmax and masked_softmax: the Triton kernels (under
TRITON_INTERPRET=1 in one child Python) forward and backward against float64 on odd
shapes in fp32 and bf16, through the one-block path and the online path; the fused scale
+ mask (additive [B, 1, S, S], boolean [B, 1, 1, S]) and its mask gradient; the CPU op,
opcheck and torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import softmax as S  # noqa: E402

SHAPES = [(5, 123), (1, 16383), (3, 7, 4097)]
#: (shape, dtype, log, single_max): every shape both ways in fp32, bf16 on two, and the
#: short row forced through the online path (single_max below its length)
CASES = [(s, torch.float32, log, S.SINGLE_MAX) for s in SHAPES for log in (False, True)] + [
    ((5, 123), torch.bfloat16, False, S.SINGLE_MAX),
    ((3, 7, 4097), torch.bfloat16, True, S.SINGLE_MAX),
    ((5, 123), torch.float32, False, 32),
    ((5, 123), torch.float32, True, 32),
]
MASKED = [((2, 3, 9, 37), "additive", S.SINGLE_MAX), ((2, 3, 9, 37), "bool", 16)]


def _key(c):
    return str([list(c[0]), str(c[1]), *c[2:]])


def _case(shape, dtype, log, single_max):
    g = torch.Generator().manual_seed(sum(shape) + log)
    x = (3 * torch.randn(shape, generator=g)).to(rc.DEVICE, dtype)
    dy = torch.randn(shape, generator=g).to(rc.DEVICE, dtype)
    y = S.triton_forward(x, log, single_max=single_max)
    dx = S.triton_backward(dy, y, log, 1.0, dtype, single_max=single_max)
    xd = x.detach().double().requires_grad_()
    yd = S.reference(xd, log)
    yd.backward(dy.double())
    xe = x.detach().clone().requires_grad_()  # PyTorch's own op in the dtype: the yardstick
    ye = torch.log_softmax(xe, -1) if log else torch.softmax(xe, -1)
    ye.backward(dy)
    return {
        "dtype": str(y.dtype),
        "shape": list(y.shape),
        "y": rc.rel(y, yd),
        "y_torch": rc.rel(ye, yd),
        "dx": rc.rel(dx, xd.grad),
        "dx_torch": rc.rel(xe.grad, xd.grad),
    }


def _masked(shape, kind, single_max):
    g = torch.Generator().manual_seed(sum(shape))
    b, _, s, n = shape
    x = torch.randn(shape, generator=g).to(rc.DEVICE)
    if kind == "bool":
        mask = (torch.rand(b, 1, 1, n, generator=g) > 0.3).to(rc.DEVICE)
        mask[..., 0] = True  # no fully masked row
    else:
        mask = torch.randn(b, 1, s, n, generator=g).to(rc.DEVICE).requires_grad_()
    y = S.triton_forward(x, False, mask, 0.125, torch.float32, single_max)
    dy = torch.randn(shape, generator=g).to(rc.DEVICE)
    xg = x.clone().requires_grad_()
    out = S.masked_softmax(xg, mask, 0.125)
    out.backward(dy)
    md = mask.detach().double().requires_grad_() if kind != "bool" else mask
    xd = x.double().requires_grad_()
    yd = S.reference(xd, False, md, 0.125)
    yd.backward(dy.double())
    return {
        "y": rc.rel(y, yd),
        "op": rc.rel(out, yd),
        "dx": rc.rel(xg.grad, xd.grad),
        "dmask": rc.rel(mask.grad, md.grad) if kind != "bool" else 0.0,
    }


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_float64(interpreted, case):
    shape, dtype = case[0], case[1]
    r = interpreted[_key(case)]
    assert r["shape"] == list(shape) and r["dtype"] == str(dtype)
    assert r["y"] <= rc.bound(dtype, r["y_torch"]), r
    assert r["dx"] <= rc.bound(dtype, r["dx_torch"]), r


@pytest.mark.parametrize("case", MASKED, ids=_key)
def test_masked_kernel_and_its_gradients_match_float64(interpreted, case):
    r = interpreted[_key(case)]
    assert max(r.values()) <= 1e-5, r


def test_cpu_ops_are_the_reference_with_fp32_output():
    x = torch.randn(4, 3, 50).bfloat16()
    assert torch.equal(S.softmax(x, torch.float32), torch.softmax(x.float(), -1))
    assert S.log_softmax(x).dtype == torch.bfloat16
    bad = torch.randn(2, 2, 2, 2, 3)  # five dims with a mask: the reference, not an error
    assert torch.allclose(S.masked_softmax(bad, bad[0], 1.0), torch.softmax(bad + bad[0], -1))
    full = torch.zeros(2, 5, dtype=torch.bool)  # a fully masked row is NaN, as eager makes it
    assert torch.isnan(S.masked_softmax(torch.randn(2, 5), full, 1.0)).all()


def test_opcheck_and_export_keep_the_ops():
    x = torch.randn(2, 3, 6, 11, requires_grad=True)
    torch.library.opcheck(S.softmax, (x, None))
    torch.library.opcheck(S.log_softmax, (x, torch.float32))
    torch.library.opcheck(S.masked_softmax, (x, torch.randn(2, 1, 6, 11), 0.5, None))
    torch.library.opcheck(S.masked_softmax, (x, torch.rand(2, 1, 1, 11) > 0.5, 0.5, None))

    class Attn(torch.nn.Module):
        def forward(self, s, m):
            return S.masked_softmax(s, m, 0.25) + S.log_softmax(s)

    ep = torch.export.export(Attn(), (x.detach(), torch.randn(2, 1, 6, 11)))
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert {torch.ops.opswap.masked_softmax.default, torch.ops.opswap.log_softmax.default} <= ops


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    out = {_key(c): _case(*c) for c in CASES}
    out.update({_key(c): _masked(*c) for c in MASKED})
    print(json.dumps(out))
