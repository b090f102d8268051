"""Chapter 22: opswap's result as an .onnx file for ONNX Runtime. A small Conv+BN+ReLU
network is planned (conv_bn folds the BatchNorm, conv_relu leaves the custom op
opswap::conv_relu, which the export lowers to Conv + Relu), exported with its batch and
image sizes dynamic, and run in ONNX Runtime at other sizes against the PyTorch model.
Then every value ONNX Runtime computes inside the file is compared with PyTorch running
the same exported graph, layer by layer (`opswap verify --backend ort --layers`).

    python examples/ch22_onnx_export.py [OUT_DIR]
"""

import sys
import tempfile
from pathlib import Path

import onnx
import torch
from torch import nn

import opswap
from opswap.api import verify_plan
from opswap.backends.ort import OrtModule


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
    plan.save(Path(out_dir) / "plan.json")
    done = opswap.export(model, (x,), plan, to="onnx", out=out_dir)
    ops = [n.op_type for n in onnx.load(str(done.path)).graph.node]
    print(f"wrote {done.path}: {', '.join(ops)}")
    v = done.verification
    print(
        f"verified in ONNX Runtime: {'passed' if v.passed else 'FAILED'} at {', '.join(v.shapes)}"
    )
    session = OrtModule(done.path)
    for shape in ((1, 3, 16, 16), (7, 3, 24, 20)):
        xs = torch.randn(*shape)
        with torch.no_grad():
            err = (session(xs) - model(xs)).abs().max().item()
        print(f"batch {shape[0]}, {shape[2]}x{shape[3]}: max abs difference {err:.2e}")
    check = verify_plan(model, (x,), plan, backend="ort", layers=True)
    rows = [r for r in check.runtime_layers.rows if r.metrics is not None]
    worst = max(rows, key=lambda r: r.metrics.rel_l2)
    print(
        f"inside ONNX Runtime: {len(rows)} values against PyTorch, largest rel_l2 "
        f"{worst.metrics.rel_l2:.1e} ({worst.name}), first divergence: "
        f"{check.runtime_divergence or 'none'}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="opswap-ch22-"))
