"""opswap::bias_act: the Triton kernels (under TRITON_INTERPRET=1 in one child Python)
forward and backward (dx and db) against float64 autograd for every activation, in fp32,
bf16 and fp16, with and without a bias, on odd, 3-D, empty and non-contiguous inputs; the
derivative at the kinks equal to PyTorch autograd's; the CPU op, bad settings, opcheck,
torch.export and torch.compile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import activation as A  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SLOPE = 0.2
#: the kinks of each piecewise activation, and NaN
KINKS = {
    "relu": [0.0],
    "relu6": [0.0, 6.0],
    "leaky_relu": [0.0],
    "hardswish": [-3.0, 3.0],
    "hardsigmoid": [-3.0, 3.0],
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return rc.rel(a, b) if b.numel() and b.double().norm() > 0 else float((a - b).abs().sum())


def _case(shape, dtype, activation, with_bias, layout):
    gen = torch.Generator().manual_seed(sum(shape) + len(activation) + 7 * with_bias)
    h = shape[-1]
    if layout == "transposed":  # x [..., H] read through a transpose: non-contiguous
        base = (torch.randn(h, *shape[:-1], generator=gen) * 3).to(rc.DEVICE, dtype)
        leaf = base.requires_grad_()
        x = leaf.movedim(0, -1)
    elif layout == "strided":  # every other element of the last dim
        leaf = (torch.randn(*shape[:-1], 2 * h, generator=gen) * 3).to(rc.DEVICE, dtype)
        leaf.requires_grad_()
        x = leaf[..., ::2]
    else:
        leaf = (torch.randn(shape, generator=gen) * 3).to(rc.DEVICE, dtype).requires_grad_()
        x = leaf
    b = (torch.randn(h, generator=gen)).to(rc.DEVICE, dtype).requires_grad_() if with_bias else None
    dy = torch.randn(shape, generator=gen).to(rc.DEVICE, dtype)
    y = A.bias_act(x, b, activation, SLOPE)
    y.backward(dy)

    # float64 truth, and eager PyTorch in the dtype (the yardstick)
    def grads(work):
        lw = leaf.detach().to(work).requires_grad_()
        xw = lw.movedim(0, -1) if layout == "transposed" else lw[..., ::2] if layout else lw
        bw = b.detach().to(work).requires_grad_() if b is not None else None
        yw = A.act(xw + bw if bw is not None else xw, activation, SLOPE)
        yw.backward(dy.to(work))
        return yw, lw.grad, (bw.grad if bw is not None else None)

    yd, dxd, dbd = grads(torch.float64)
    ye, dxe, dbe = grads(dtype)
    out = {
        "shape": list(y.shape),
        "dtype": str(y.dtype),
        "contiguous": y.is_contiguous(),
        "y": _rel(y, yd),
        "y_torch": _rel(ye, yd),
        "dx": _rel(leaf.grad, dxd),
        "dx_torch": _rel(dxe, dxd),
    }
    if b is not None:
        out.update(db=_rel(b.grad, dbd), db_torch=_rel(dbe, dbd), db_dtype=str(b.grad.dtype))
    return out


def _kinks(activation):
    """(our y and dx, autograd's y and dx) at the kinks and NaN, reached as x + b with
    b = 1: exact in fp32."""
    pts = torch.tensor([*KINKS[activation], float("nan"), 1.5, -4.0])
    x = (pts - 1).to(rc.DEVICE).requires_grad_()
    b = torch.ones_like(x).requires_grad_()
    y = A.bias_act(x, b, activation, SLOPE)
    y.backward(torch.ones_like(y))
    p = pts.clone().requires_grad_()
    yt = A.act(p, activation, SLOPE)
    yt.backward(torch.ones_like(yt))
    listed = [t.detach().cpu().tolist() for t in (y, x.grad, b.grad, yt, p.grad)]
    return dict(zip(("y", "dx", "db", "y_torch", "dx_torch"), listed, strict=True))


def _key(c):
    return str([list(c[0]), str(c[1]), c[2], c[3], c[4]])


# every activation in every dtype with a bias, and without one in a dtype of each; long
# rows, 3-D, empty and non-contiguous inputs for a few
CASES = (
    [((5, 123), dt, a, True, "") for a in A.ACTIVATIONS for dt in DTYPES]
    + [((5, 123), DTYPES[i % 3], a, False, "") for i, a in enumerate(A.ACTIVATIONS)]
    + [
        ((1, 16383), torch.bfloat16, "gelu_tanh", True, ""),
        ((1, 16383), torch.float16, "leaky_relu", False, ""),
        ((3, 7, 129), torch.float32, "hardswish", True, ""),
        ((3, 7, 129), torch.bfloat16, "quick_gelu", True, ""),
        ((0, 64), torch.bfloat16, "relu6", True, ""),
        ((2, 0, 8), torch.float32, "gelu", True, ""),
        ((6, 123), torch.bfloat16, "silu", True, "transposed"),
        ((4, 3, 37), torch.float32, "gelu", True, "strided"),
    ]
)


@pytest.fixture(scope="module")
def interpreted():
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_kernel_in_the_interpreter_matches_float64(interpreted, case):
    r = interpreted[_key(case)]
    shape, dtype, _, with_bias, _ = case
    assert r["shape"] == list(shape) and r["dtype"] == str(dtype) and r["contiguous"], r
    assert r["y"] <= rc.bound(dtype, r["y_torch"]), r
    assert r["dx"] <= rc.bound(dtype, r["dx_torch"]), r
    if with_bias:
        assert r["db_dtype"] == str(dtype)
        assert r["db"] <= rc.bound(dtype, r["db_torch"]), r


@pytest.mark.parametrize("activation", list(KINKS))
def test_the_kernels_derivative_at_kinks_is_pytorchs(interpreted, activation):
    r = interpreted[f"kinks {activation}"]
    assert r["dx"] == pytest.approx(r["dx_torch"], nan_ok=True), r
    assert r["db"] == pytest.approx(r["dx_torch"], nan_ok=True), r
    assert r["y"] == pytest.approx(r["y_torch"], nan_ok=True), r


@pytest.mark.parametrize("activation", list(KINKS))
def test_the_cpu_ops_derivative_at_kinks_is_pytorchs(activation):
    r = _kinks(activation)
    assert r["dx"] == pytest.approx(r["dx_torch"], nan_ok=True), r
    assert r["y"] == pytest.approx(r["y_torch"], nan_ok=True), r


def test_the_reference_activations_are_pytorchs_own():
    s = torch.randn(257, dtype=torch.float64) * 4
    assert torch.equal(A.act(s, "gelu_tanh", 0.0), F.gelu(s, approximate="tanh"))
    assert torch.equal(A.act(s, "leaky_relu", 0.3), F.leaky_relu(s, 0.3))
    assert torch.allclose(A.act(s, "quick_gelu", 0.0), s / (1 + torch.exp(-1.702 * s)))


@pytest.mark.parametrize("activation", A.ACTIVATIONS)
def test_cpu_op_and_its_gradients_match_float64(activation):
    x = torch.randn(4, 3, 33, dtype=torch.float64) * 3
    b = torch.randn(33, dtype=torch.float64)
    xf, bf = x.float().requires_grad_(), b.float().requires_grad_()
    y = A.bias_act(xf, bf, activation, SLOPE)
    y.backward(torch.ones_like(y))
    xd, bd = x.clone().requires_grad_(), b.clone().requires_grad_()
    yd = A.act(xd + bd, activation, SLOPE)
    yd.backward(torch.ones_like(yd))
    assert rc.rel(y, yd) <= 1e-6
    assert rc.rel(xf.grad, xd.grad) <= 1e-5 and rc.rel(bf.grad, bd.grad) <= 1e-5


@pytest.mark.parametrize("activation, with_bias", [("gelu_tanh", True), ("leaky_relu", False)])
def test_opcheck(activation, with_bias):
    x = torch.randn(3, 5, 17, requires_grad=True)
    b = torch.randn(17, requires_grad=True) if with_bias else None
    torch.library.opcheck(A.bias_act, (x, b, activation, SLOPE))


def test_bad_settings_are_refused_in_one_sentence():
    with pytest.raises(A.KernelError, match="'mish' is not one of relu, relu6, .*quick_gelu"):
        A.bias_act(torch.randn(2, 4), None, "mish", 0.0)
    with pytest.raises(A.KernelError, match="1-D with x's last dim \\(4\\) values; got shape"):
        A.bias_act(torch.randn(2, 4), torch.randn(2, 4), "relu", 0.0)
    with pytest.raises(A.KernelError, match="floating-point tensor"):
        A.bias_act(torch.randn(2, 4), torch.ones(4, dtype=torch.int64), "relu", 0.0)


class _M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return A.bias_act(x, self.b, "gelu_tanh", 0.0) * 2


def test_export_keeps_the_op_and_compile_takes_it_with_its_backward():
    ep = torch.export.export(_M(), (torch.randn(3, 8),))
    assert torch.ops.opswap.bias_act.default in {n.target for n in ep.graph.nodes}
    m = _M()
    x = torch.randn(5, 8, requires_grad=True)
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    yt = A.act(x2 + m.b.detach(), "gelu_tanh") * 2
    yt.sum().backward()
    assert torch.allclose(y, yt, atol=1e-6) and torch.allclose(x.grad, x2.grad, atol=1e-6)


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    out = {_key(c): _case(*c) for c in CASES}
    out.update({f"kinks {a}": _kinks(a) for a in KINKS})
    print(json.dumps(out))
