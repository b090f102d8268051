"""`import opswap`: the public API, and opswap's ops registered with torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch import nn

import opswap
import opswap.kernels  # noqa: F401  (to build the file here; the fresh process imports opswap only)


class _ConvReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x):
        return torch.ops.opswap.conv_relu(
            x, self.conv.weight, self.conv.bias, [1, 1], [1, 1], [1, 1], 1
        )


def test_a_plain_torch_export_load_works_after_import_opswap(tmp_path):
    torch.manual_seed(0)
    model = _ConvReLU().eval()
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 3, 8, 8),)), path)
    x = torch.randn(2, 3, 8, 8)
    torch.save(x, tmp_path / "x.pt")
    script = textwrap.dedent(f"""
        import torch, opswap
        program = torch.export.load({str(path)!r})
        torch.save(program.module()(torch.load({str(tmp_path / "x.pt")!r})), {str(tmp_path / "y.pt")!r})
    """)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    with torch.no_grad():
        want = torch.relu(model.conv(x))
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), want)


def test_the_public_api_is_listed():
    assert set(opswap.__all__) <= set(dir(opswap))
    assert "kernels" not in opswap.__all__
