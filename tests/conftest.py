import os
import tempfile

import pytest
import torch

# Timing loops stop after a second (bench.timing.time_cap): tests check what the pipeline
# does and writes, never the figures, which benchmarks/ measures. Subprocesses the tests
# start (the examples, the CLI) inherit it.
os.environ.setdefault("OPSWAP_MAX_TIME_S", "1")
# AOTInductor packages of a compiled winner take a minute or more of C++ compilation on
# these CPUs: tests that save a compiled winner skip them, and the one test of the package
# (tests/backends/test_aoti.py) asks for it with save(..., aot=True)
os.environ.setdefault("OPSWAP_AOT", "0")
# The tuning database (opswap.tuning) is on by default in the user's cache directory: the
# suite, and the subprocesses it starts, keep theirs in a directory of their own instead
os.environ.setdefault(
    "OPSWAP_TUNING_DB", os.path.join(tempfile.mkdtemp(prefix="opswap-tests-"), "tuning.sqlite")
)


@pytest.fixture
def one_torch_thread():
    """Run a test on one intra-op thread. Small ops on 2 threads stall for a whole
    scheduler slice whenever another process holds a core (15 ms for a 0.1 ms conv);
    tests that measure no speed gain nothing from the second thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def wide_cli_console(monkeypatch):
    """The CLI's console at a fixed 160 columns, whatever COLUMNS the machine running the
    tests sets (CI's 80 wrapped table cells mid-word). A test of narrow output replaces it
    again with its own width."""
    from rich.console import Console

    monkeypatch.setattr("opswap.cli.consoles.console", Console(width=160))
