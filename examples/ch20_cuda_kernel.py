"""Chapter 20: a CUDA C++ kernel as a torch op (`opswap::bias_gelu_cuda`, gelu(x + b)).

On any machine: the op and its backward op are registered with torch.library (a fake
implementation and an autograd formula), so torch.export records the op in the graph,
and `torch.library.opcheck` checks the registration; on a CPU the op computes its
PyTorch reference, and the script says why the extension cannot be built here. With a
CUDA GPU and nvcc: the extension is built at first use (cached), forward and backward are
checked against float64, and the op is timed against eager `F.gelu(x + b)`.

    python examples/ch20_cuda_kernel.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opswap.kernels import bias_gelu_cuda as B


class BiasGelu(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, x):
        return B.bias_gelu_cuda(x, self.b)


def main() -> None:
    x, b = torch.randn(6, 130), torch.randn(130)
    torch.library.opcheck(B.bias_gelu_cuda, (x.clone().requires_grad_(), b))
    torch.library.opcheck(B.bias_gelu_cuda_backward, (torch.randn(6, 130), x, b))
    print("opcheck: the op and its backward are registered consistently")
    ep = torch.export.export(BiasGelu(130), (x,))
    ops = sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"})
    print("torch.export records:", ", ".join(ops))
    why = B.unavailable()
    if why is not None:
        print(f"the CUDA extension cannot be built here: {why}")
        same = bool(torch.allclose(B.bias_gelu_cuda(x, b), F.gelu(x + b)))
        print("on this CPU the op runs its PyTorch reference, equal to F.gelu(x + b):", same)
        return
    B.build()
    xg = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bg = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = B.bias_gelu_cuda(xg, bg)
    dy = torch.randn_like(y)
    y.backward(dy)
    xd, bd = xg.detach().double().requires_grad_(), bg.detach().double().requires_grad_()
    F.gelu(xd + bd).backward(dy.double())
    print("max |y - float64|:", float((y.double() - F.gelu(xd + bd)).abs().max()))
    print("rel L2 of dx:", float((xg.grad.double() - xd.grad).norm() / xd.grad.norm()))
    print("rel L2 of db:", float((bg.grad.double() - bd.grad).norm() / bd.grad.norm()))
    import triton.testing

    with torch.no_grad():
        ours = triton.testing.do_bench(lambda: B.bias_gelu_cuda(xg, bg), return_mode="median")
        eager = triton.testing.do_bench(lambda: F.gelu(xg + bg), return_mode="median")
    gbs = 2 * xg.numel() * 2 / (ours * 1e-3) / 1e9
    print(f"forward: ours {ours:.3f} ms ({gbs:.0f} GB/s), eager {eager:.3f} ms")


if __name__ == "__main__":
    main()
