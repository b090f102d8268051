"""The code is formatted (`ruff format`), lint-clean (`ruff check`) and type-checks (`mypy`,
configured in pyproject.toml): the suite fails on a change that skipped the pre-commit hooks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ["src", "tests", "examples", "benchmarks"]


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_the_code_is_formatted_and_lint_clean():
    fmt = _run("ruff", "format", "--check", *CODE)
    assert fmt.returncode == 0, f"run `ruff format`:\n{fmt.stdout}{fmt.stderr}"
    lint = _run("ruff", "check", *CODE)
    assert lint.returncode == 0, f"run `ruff check --fix`:\n{lint.stdout}{lint.stderr}"


def test_mypy_passes():
    out = _run("mypy", "--cache-dir", str(ROOT / ".mypy_cache"), timeout=1500)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
