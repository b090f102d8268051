"""The command keeps libraries' import-time log lines that say nothing to its user off the
screen: torchao's CPU build failing to load its CUDA-only extensions, which transformers
triggers whenever it loads a model (two "Failed to load ..." lines before any output)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PROBE = """
import sys
sys.path.insert(0, {src!r})
if {quiet}:
    from opswap.cli.app import quiet_import_noise
    quiet_import_noise()
import torchao  # what transformers imports when it loads a model
"""


def _stderr(quiet: bool) -> str:
    code = PROBE.format(src=str(SRC), quiet=quiet)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


def test_torchaos_import_lines_are_kept_off_the_commands_output():
    pytest.importorskip("torchao")
    loud = _stderr(quiet=False)
    if "Failed to load" not in loud:
        pytest.skip("this torchao build loads all its extensions here: nothing to keep off")
    assert "Failed to load" not in _stderr(quiet=True)
