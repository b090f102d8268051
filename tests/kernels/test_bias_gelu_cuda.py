"""opswap::bias_gelu_cuda: the CUDA C++ kernel against F.gelu(x + b) in float64 at odd sizes
(odd N takes the scalar path, even N the paired loads) in fp32, fp16 and bf16, forward and
backward, and through torch.compile (on a GPU: the GPU suite runs it); everywhere, the
reference on CPU, the fake for export, and the error that says why it cannot build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opswap.kernels import bias_gelu_cuda as B

WHY = B.unavailable()
gpu = pytest.mark.skipif(WHY is not None, reason=f"bias_gelu_cuda cannot build here: {WHY}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(5, 123), (3, 7, 4096), (1, 16383), (2, 1026), (1037, 258), (40, 3, 77)]
)
def test_kernel_matches_float64(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = torch.randn(shape, device="cuda", generator=g).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], device="cuda", generator=g).to(dtype).requires_grad_()
    y = B.bias_gelu_cuda(x, b)
    dy = torch.randn_like(y)
    y.backward(dy)
    xd, bd = (t.detach().double().requires_grad_() for t in (x, b))
    yd = F.gelu(xd + bd)
    yd.backward(dy.double())
    eager = F.gelu(x.detach() + b.detach())  # PyTorch's own in the dtype: the yardstick
    tol = (
        1e-6 if dtype == torch.float32 else 3 * max(float((eager.double() - yd).abs().max()), 1e-3)
    )
    assert float((y.double() - yd).abs().max()) <= tol
    assert torch.allclose(x.grad.double(), xd.grad, rtol=2e-2, atol=tol * 4)
    assert torch.allclose(b.grad.double(), bd.grad, rtol=2e-2, atol=tol * shape[0] * 8)


@gpu
def test_compile_keeps_the_op():
    x, b = torch.randn(6, 130, device="cuda"), torch.randn(130, device="cuda")
    fn = torch.compile(lambda x, b: B.bias_gelu_cuda(x, b) * 2, fullgraph=True)
    assert torch.allclose(fn(x, b), 2 * F.gelu(x + b), atol=1e-5)


def test_the_backward_op_is_the_derivative_on_cpu():
    # the reference path of opswap::bias_gelu_cuda_backward against autograd in float64
    g = torch.Generator().manual_seed(7)
    x, b = torch.randn(9, 37, generator=g), torch.randn(37, generator=g)
    dy = torch.randn(9, 37, generator=g)
    dx, db = B.bias_gelu_cuda_backward(dy, x, b)
    xd, bd = x.double().requires_grad_(), b.double().requires_grad_()
    F.gelu(xd + bd).backward(dy.double())
    assert db.dtype == torch.float32 and dx.dtype == x.dtype
    torch.testing.assert_close(dx.double(), xd.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(db.double(), bd.grad, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(B.bias_gelu_cuda_backward, (dy, x, b))


def test_cpu_is_the_reference_and_export_records_the_op():
    x, b = torch.randn(4, 33), torch.randn(33)
    assert torch.allclose(B.bias_gelu_cuda(x, b), F.gelu(x + b), atol=1e-6)
    torch.library.opcheck(B.bias_gelu_cuda, (x.requires_grad_(), b))

    class M(torch.nn.Module):
        def forward(self, x, b):
            return B.bias_gelu_cuda(x, b)

    ep = torch.export.export(M(), (x.detach(), b))
    assert torch.ops.opswap.bias_gelu_cuda.default in {n.target for n in ep.graph.nodes}


@pytest.mark.skipif(WHY is None, reason="the extension can build here")
def test_build_says_why_it_cannot():
    with pytest.raises(B.ExtensionError, match="cannot be built: .*use the eager"):
        B.build()


def test_the_sources_ship_with_the_package():
    assert all(p.is_file() for p in B.SOURCES)
