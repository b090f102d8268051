"""The commands print opswap's own lines only: no warning of torch, Inductor, the ONNX
exporter or ONNX Runtime on stderr while a small model is optimized, raced against
torch.compile and ONNX Runtime, exported to ONNX and verified layer by layer there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["--set", "hidden=32", "--set", "layers=1", "--set", "heads=2"]
TINY += ["--set", "intermediate=64", "--set", "seq=12"]
#: what a library's warning looks like on stderr: Python's warnings (UserWarning: ...),
#: logging's default format (WARNING:torch...), glog's (W1207 16:01:02.123 ...), torch's
#: C++ warnings ([W1207 ...]) and ONNX Runtime's log lines ([E:onnxruntime:, ...], coloured)
LOUD = re.compile(r"Warning\b|^WARNING\b|^\[?W\d{4} |\[[EW]:onnxruntime", re.MULTILINE)


def _opswap(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "160", "OPSWAP_MAX_TIME_S": "1"}
    return subprocess.run(
        [sys.executable, "-P", "-m", "opswap.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )


@pytest.mark.slow
def test_optimize_export_and_layers_print_no_library_warnings(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = tmp_path / "out"
    done = _opswap(
        "optimize", "zoo:bert", *TINY, "--samples", "1", "--compare", "compile",
        "--export", "onnx", "--out", out, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not LOUD.search(done.stderr), done.stderr[-3000:]
    layers = _opswap(
        "verify", "zoo:bert", out / "plan.json", *TINY, "--samples", "1", "--backend", "ort",
        "--layers", cwd=tmp_path,
    )  # fmt: skip
    assert layers.returncode == 0, layers.stderr[-3000:]
    assert "layer by layer" in layers.stdout
    assert not LOUD.search(layers.stderr), layers.stderr[-3000:]
