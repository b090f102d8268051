"""opswap::group_norm: the Triton kernels (under TRITON_INTERPRET=1 in one child Python)
forward and backward (dx, dw, db) against float64 on odd shapes (no spatial dims, three
spatial dims, a group several chunks long) in fp32, bf16 and fp16, with and without the
affine, and InstanceNorm through the same kernel; the CPU op against F.group_norm;
opcheck and torch.export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import group_norm as GN  # noqa: E402


def _norm(kind, x, groups, w, b):
    if kind == "instance":
        return F.instance_norm(x, weight=w, bias=b, eps=1e-5)
    return F.group_norm(x, groups, w, b, 1e-5)


def _case(shape, groups, dtype, affine, kind):
    g = torch.Generator().manual_seed(sum(shape) + groups + affine)
    c = shape[1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(rc.DEVICE, dtype).requires_grad_()
    w = (torch.rand(c, generator=g) + 0.5).to(rc.DEVICE, dtype).requires_grad_() if affine else None
    b = torch.randn(c, generator=g).to(rc.DEVICE, dtype).requires_grad_() if affine else None
    dy = torch.randn(shape, generator=g).to(rc.DEVICE, dtype)
    if kind == "instance":
        y = GN.instance_norm(x, w, b, 1e-5)
    else:
        y = GN.group_norm(x, groups, w, b, 1e-5)
    y.backward(dy)
    leaves = [t for t in (x, w, b) if t is not None]
    d = [t.detach().double().requires_grad_() for t in leaves]
    e = [t.detach().clone().requires_grad_() for t in leaves]
    yd = _norm(kind, d[0], groups, *(d[1:] if affine else (None, None)))
    yd.backward(dy.double())
    ye = _norm(kind, e[0], groups, *(e[1:] if affine else (None, None)))
    ye.backward(dy)
    return {
        "dtype": str(y.dtype),
        "shape": list(y.shape),
        "y": rc.rel(y, yd),
        "y_torch": rc.rel(ye, yd),
        "grads": [rc.rel(a.grad, b.grad) for a, b in zip(leaves, d, strict=True)],
        "grads_torch": [rc.rel(a.grad, b.grad) for a, b in zip(e, d, strict=True)],
    }


#: (shape, groups) (13 x 17 and the three spatial dims take the forward's [channels,
#: positions] tile, the others its flat form): 2-D spatial; no spatial dims (3 channels a group); 8 groups of 4
#: channels at 13 x 17; one group of 6400 (held in registers forward, two chunks a channel
#: backward); one group of 2 x 91 x 91 = 16562 values, past the 16384 the forward holds
#: (chunks forward); three spatial dims
SHAPES = [
    ((3, 6, 7, 7), 3),
    ((3, 12), 4),
    ((2, 32, 13, 17), 8),
    ((2, 4, 40, 40), 1),
    ((1, 2, 91, 91), 1),
    ((2, 3, 5, 4, 3), 3),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = (
    [(s, g, dt, True, "group") for s, g in SHAPES[:3] for dt in DTYPES]
    + [(s, g, torch.float32, True, "group") for s, g in SHAPES[3:]]
    + [
        ((2, 4, 40, 40), 1, torch.bfloat16, False, "group"),
        ((3, 6, 7, 7), 3, torch.float32, False, "group"),
        ((2, 5, 9, 11), 5, torch.float32, True, "instance"),
        ((2, 5, 9, 11), 5, torch.bfloat16, True, "instance"),
        ((3, 4, 33), 4, torch.float32, False, "instance"),
        ((2, 4, 8, 8), 4, torch.bfloat16, False, "instance"),  # the [channel, position] tile
    ]
)


def _key(c):
    return str([list(c[0]), c[1], str(c[2]), c[3], c[4]])


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_float64(interpreted, case):
    r = interpreted[_key(case)]
    assert r["shape"] == list(case[0]) and r["dtype"] == str(case[2])
    assert r["y"] <= rc.bound(case[2], r["y_torch"]), r
    assert len(r["grads"]) == (3 if case[3] else 1)
    for got, own in zip(r["grads"], r["grads_torch"], strict=True):
        assert got <= rc.bound(case[2], own), r


def test_cpu_op_is_f_group_norm_and_export_keeps_it():
    x, w, b = (
        torch.randn(2, 6, 5, 3).bfloat16(),
        torch.rand(6).bfloat16(),
        torch.randn(6).bfloat16(),
    )
    assert torch.equal(GN.group_norm(x, 3, w, b, 1e-6), F.group_norm(x, 3, w, b, 1e-6))
    inst = F.instance_norm(x.float(), weight=w.float(), bias=b.float(), eps=1e-6)
    assert torch.allclose(GN.instance_norm(x, w, b, 1e-6).float(), inst, rtol=2e-2, atol=2e-2)
    torch.library.opcheck(
        GN.group_norm, (x.float().requires_grad_(), 3, w.float().requires_grad_(), None, 1e-5)
    )
    gn = torch.nn.GroupNorm(2, 4)

    class M(torch.nn.Module):
        def forward(self, x):
            return GN.group_norm(x, 2, gn.weight, gn.bias, 1e-5) * 2

    ep = torch.export.export(M(), (torch.randn(3, 4, 5, 5),))
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.opswap.group_norm.default in ops


def test_cpu_backward_is_f_group_norms():
    x = torch.randn(3, 6, 4, 5, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 6, 4, 5, dtype=torch.float64)
    ours = torch.autograd.grad(
        GN.group_norm(x.float(), 3, w.float(), b.float(), 1e-5), (x, w, b), dy.float()
    )
    theirs = torch.autograd.grad(F.group_norm(x, 3, w, b, 1e-5), (x, w, b), dy)
    for a, e in zip(ours, theirs, strict=True):
        assert rc.rel(a, e) < 1e-5


def test_reference_is_f_group_norm():
    x = torch.randn(3, 8, 5, 7, dtype=torch.float64)
    w, b = torch.rand(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    assert torch.allclose(GN.reference(x, 4, w, b, 1e-5), F.group_norm(x, 4, w, b, 1e-5))


def test_chunks_of_a_symbolic_size_need_no_guard():
    """torch.export and a dynamic torch.compile trace the launch with symbolic N and
    spatial sizes: the chunk is then the cap (the walks take any length), so no guard
    narrows the sizes the capture claims."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    n = ShapeEnv().create_unbacked_symint()
    assert GN._block(n * 3, GN.MAX_BLOCK) == GN.MAX_BLOCK
    assert GN._block(5, GN.MAX_BLOCK) == 16 and GN._block(3000, GN.MAX_BLOCK) == 2048


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_key(c): _case(*c) for c in CASES}))
