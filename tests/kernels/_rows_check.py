"""What the interpreter tests of the row kernels share: the relative error of a result
against float64, the bound a low-precision kernel may err by (a small multiple of what
PyTorch's own computation errs in the same dtype), and the child Python that runs a test
file's cases under TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[2] / "src"
#: odd shapes: a row shorter than a block, one long row, a 3-D input with a row past 4 K
SHAPES = [(5, 123), (1, 16383), (3, 7, 4097)]
DTYPES = [torch.float32, torch.bfloat16]
#: where a child puts the cases' tensors: the CPU under the interpreter, or the GPU, where
#: the child runs the compiled kernels instead (run_child decides)
DEVICE = os.environ.get("OPSWAP_ROWS_DEVICE", "cpu")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def bound(dtype: torch.dtype, torch_err: float) -> float:
    """fp32: rounding of a reordered sum; bf16: 3x PyTorch's own error, floored at
    bfloat16's unit roundoff."""
    if dtype == torch.float32:
        return 1e-5
    return 3 * max(torch_err, 2.0**-9)


def run_child(test_file: str) -> dict:
    """The test file's `__main__` cases, run once in a child Python with TRITON_INTERPRET=1
    (Triton picks the interpreter when a kernel is jitted, before opswap is imported); on
    a machine with a CUDA GPU, the same cases on the GPU through the compiled kernels."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(SRC)}
    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET")
        env["OPSWAP_ROWS_DEVICE"] = "cuda"
    run = subprocess.run(
        [sys.executable, test_file], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
