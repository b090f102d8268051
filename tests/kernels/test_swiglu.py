"""opswap::glu and opswap::glu_packed: the Triton kernels (under TRITON_INTERPRET=1 in one
child Python) forward and backward against float64 for silu, gelu and gelu_tanh on odd
shapes in fp32 and bf16, the packed form equal to the two-tensor one; the CPU op, bad
settings, opcheck and torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import swiglu as S  # noqa: E402


def _case(shape, dtype, activation, flat=False):
    S.FLAT = flat  # g and u apart (contiguous) take the flat forward
    gen = torch.Generator().manual_seed(sum(shape) + len(activation))
    x = (
        (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 2)
        .to(rc.DEVICE, dtype)
        .requires_grad_()
    )
    dy = torch.randn(shape, generator=gen).to(rc.DEVICE, dtype)
    y = S.glu_packed(x, activation)
    y.backward(dy)
    g, u = (t.detach().clone().requires_grad_() for t in S.halves(x))
    y2 = S.glu(g, u, activation)
    y2.backward(dy)
    xd = x.detach().double().requires_grad_()
    gd, ud = S.halves(xd)
    (S.act(gd, activation) * ud).backward(dy.double())
    xe = x.detach().clone().requires_grad_()
    ge, ue = S.halves(xe)
    ye = S.act(ge, activation) * ue  # eager in the dtype: the yardstick
    ye.backward(dy)
    return {
        "dtype": str(y.dtype),
        "shape": list(y.shape),
        "y": rc.rel(y, S.act(gd, activation) * ud),
        "y_torch": rc.rel(ye, S.act(gd, activation) * ud),
        "dx": rc.rel(x.grad, xd.grad),
        "dx_torch": rc.rel(xe.grad, xd.grad),
        "two_equal": bool(
            torch.equal(y, y2) and torch.equal(torch.cat([g.grad, u.grad], -1), x.grad)
        ),
    }


CASES = [((5, 123), dt, a) for dt in rc.DTYPES for a in S.ACTIVATIONS] + [
    ((3, 7, 1029), torch.bfloat16, "silu"),
    ((1, 4097), torch.float32, "gelu_tanh"),
    ((3, 7, 1029), torch.bfloat16, "silu", True),
    ((5, 123), torch.float32, "gelu", True),
]


def _key(c):
    return str([list(c[0]), str(c[1]), *c[2:]])


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_float64(interpreted, case):
    r = interpreted[_key(case)]
    assert r["shape"] == list(case[0]) and r["dtype"] == str(case[1])
    assert r["y"] <= rc.bound(case[1], r["y_torch"]), r
    assert r["dx"] <= rc.bound(case[1], r["dx_torch"]), r
    assert r["two_equal"], "the packed and the two-tensor ops disagree"


@pytest.mark.parametrize("activation", S.ACTIVATIONS)
def test_cpu_ops_match_float64_and_their_gradients(activation):
    x = torch.randn(4, 2 * 33, dtype=torch.float64)
    g, u = S.halves(x.float().requires_grad_())
    torch.library.opcheck(S.glu, (g.detach().requires_grad_(), u.detach(), activation))
    y = S.glu_packed(x.float(), activation)
    truth = S.act(x[:, :33], activation) * x[:, 33:]
    assert rc.rel(y, truth) <= 1e-6


def test_bad_settings_are_refused_in_one_sentence():
    with pytest.raises(S.KernelError, match="not one of silu, gelu, gelu_tanh"):
        S.glu(torch.randn(2, 4), torch.randn(2, 4), "relu")
    with pytest.raises(S.KernelError, match="even last dim"):
        S.glu_packed(torch.randn(2, 5), "silu")


def test_export_keeps_the_packed_op():
    class M(torch.nn.Module):
        def forward(self, x):
            return S.glu_packed(x, "silu") + 1

    ep = torch.export.export(M(), (torch.randn(3, 8),))
    assert torch.ops.opswap.glu_packed.default in {n.target for n in ep.graph.nodes}


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
