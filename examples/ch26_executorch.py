"""Chapter 26: opswap's result as an ExecuTorch program (.pte, XNNPACK delegate), the edge
path. A small Conv+BN+ReLU network is planned (conv_bn folds the BatchNorm, conv_relu
leaves opswap::conv_relu, which the lowering traces back into ATen ops for XNNPACK),
written as model.pte with its batch and image sizes dynamic up to a bound, verified in
ExecuTorch's runtime, and run at another size against the PyTorch model. Then an
attention block calling scaled_dot_product_attention with a padding mask is lowered twice,
as ExecuTorch lowers it and with opswap's attention written out for XNNPACK: the ops left
on ExecuTorch's portable kernels are counted, both files timed, and padded rows checked.

    python examples/ch26_executorch.py [OUT_DIR]
"""

import sys
import tempfile
import time

import torch
from torch import nn

import opswap
from opswap.backends.executorch import ExecuTorchModule, lower_to_edge, to_pte
from opswap.backends.pt2 import export
from opswap.errors import InputError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 3, 16, 16)
    plan = opswap.plan(model, (x,), rules="fusion.conv_bn,fusion.conv_relu")
    done = opswap.export(model, (x,), plan, to="executorch", out=out_dir)
    v = done.verification
    print(f"wrote {done.path} ({done.path.stat().st_size} bytes); {done.note}")
    print(f"verified in ExecuTorch: {'passed' if v.passed else 'FAILED'} at {', '.join(v.shapes)}")
    program = ExecuTorchModule(done.path)
    xs = torch.randn(5, 3, 20, 24)
    with torch.no_grad():
        err = (program(xs) - model(xs)).abs().max().item()
    print(f"batch 5, 20x24: max abs difference {err:.2e}")
    try:
        opswap.load_optimized(out_dir)(torch.randn(9, 3, 16, 16))
    except InputError as e:  # the saved result knows its bounds
        print(f"batch 9: {e}")


class Attend(nn.Module):
    """Self-attention over 64-wide tokens, 4 heads, keys masked where `keep` is False."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :] & keep[:, None, :, None]
        h = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h.transpose(1, 2).reshape(b, n, 64))


def attention(out_dir: str) -> None:
    torch.manual_seed(0)
    model = Attend().eval()
    x, keep = torch.randn(1, 96, 64), torch.ones(1, 96, dtype=torch.bool)
    keep[:, 80:] = False  # padding: these queries see no key, and the op returns 0 there
    program, _, kept = export(model, (x, keep))
    files = {}
    for name, ours in (("ExecuTorch's lowering", False), ("opswap's lowering", True)):
        edge = lower_to_edge(program, kept, lowerings=ours)
        nodes = edge.exported_program().graph.nodes
        portable = [
            n
            for n in nodes
            if n.op == "call_function" and not {"delegate", "getitem"} & set(n.name.split("_"))
        ]
        path = to_pte(program, f"{out_dir}/attend_{int(ours)}.pte", kept, lowerings=ours)
        files[name] = ExecuTorchModule(path)
        print(f"{name}: {len(portable)} calls left to the portable kernels")
    with torch.no_grad():
        want = model(x, keep)
    for name, module in files.items():
        got = module(x, keep)
        for _ in range(5):
            module(x, keep)
        t0 = time.perf_counter()
        for _ in range(50):
            module(x, keep)
        ms = (time.perf_counter() - t0) / 50 * 1e3
        err = (got - want).abs().max().item()
        print(f"{name}: {ms:.3f} ms a call, max abs difference {err:.2e}")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="opswap-ch26-")
    main(out)
    attention(out)
