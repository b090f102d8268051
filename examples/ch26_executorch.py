"""Chapter 26: opswap's result as an ExecuTorch program (.pte, XNNPACK delegate), the edge
path. A small Conv+BN+ReLU network is planned (conv_bn folds the BatchNorm, conv_relu
leaves opswap::conv_relu, which the lowering traces back into ATen ops for XNNPACK),
written as model.pte with its batch and image sizes dynamic up to a bound, verified in
ExecuTorch's runtime, and run at another size against the PyTorch model.

    python examples/ch26_executorch.py [OUT_DIR]
"""

import sys
import tempfile

import torch
from torch import nn

import opswap
from opswap.backends.executorch import ExecuTorchModule
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


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="opswap-ch26-"))
