"""backends.aoti: a compiled winner is saved as an AOTInductor package as well, verified,
and load_optimized loads it with no torch.compile, behind model.pt2's input check (other
batch sizes run; a size the program holds fixed is refused in one sentence); result.json
gives both ways' time from load to the first output."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import opswap
from opswap.backends.aoti import AotiModule
from opswap.config import OptimizeConfig
from opswap.errors import InputError
from opswap.pipeline import optimize

from ..bench.test_variants import _faked_race


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_a_compiled_winner_loads_from_its_package_without_compiling(monkeypatch, tmp_path):
    from opswap.bench import variants

    torch.manual_seed(0)
    m = Net().eval()
    x = torch.randn(2, 3, 12, 12)
    monkeypatch.setattr(
        variants, "race", _faked_race(opswap_compile=10.0, captured=1.0, opswap=1.0, compile=1.0)
    )  # the others faked too: on a busy machine a real time can be anything
    r = optimize(m, (x,), OptimizeConfig(samples=1, layers=False, measure_rules=False))
    assert r.best == "opswap+compile"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        r.save(tmp_path, aot=True)
    # AOTInductor copies the program: torch's LeafSpec FutureWarning reached the CLI
    assert not [w for w in said if "LeafSpec" in str(w.message)], [str(w.message) for w in said]
    deploy = json.loads((tmp_path / "result.json").read_text())["deploy"]
    assert deploy["aot"]["package"] == "model_aoti.pt2", deploy["aot"]
    assert set(deploy["aot"]["load_to_first_call_s"]) == {"aot", "compile"}
    assert "no torch.compile at load" in deploy["how"]
    assert (
        "Saved compiled ahead of time as `model_aoti.pt2`" in (tmp_path / "report.md").read_text()
    )

    def no_compile(*a, **k):
        raise AssertionError("load_optimized compiled a packaged model")

    monkeypatch.setattr(torch, "compile", no_compile)
    loaded = opswap.load_optimized(tmp_path)
    assert isinstance(loaded, AotiModule)
    with torch.inference_mode():
        for b in (1, 5):
            other = torch.randn(b, 3, 12, 12)
            torch.testing.assert_close(loaded(other), m(other), rtol=1e-4, atol=1e-5)
        with pytest.raises(InputError, match="dim 1"):
            loaded(torch.randn(2, 4, 12, 12))  # channels are fixed: one sentence
    # the package is removed by a later save that writes none
    r.save(tmp_path, aot=False)
    assert not (tmp_path / "model_aoti.pt2").exists()


def test_a_package_whose_loading_crashes_is_dropped_with_the_reason(tmp_path):
    """Loading runs in a child Python first: a child killed by a signal (the segmentation
    fault torch 2.11 gave inside aoti_load_package on an H100) ends as one sentence naming
    the signal, and this process lives on."""
    from opswap.backends import aoti
    from opswap.errors import OpswapError

    crash = tmp_path / "python"
    crash.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crash.chmod(0o755)
    with pytest.raises(OpswapError, match="crashed that process \\(SIGSEGV\\)"):
        aoti.first_call_in_child(
            tmp_path / "p.pt2", tmp_path / "m.pt2", (torch.ones(1),), python=str(crash)
        )
    broken = tmp_path / "fails"
    broken.write_text("#!/bin/sh\necho 'RuntimeError: no such package' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(OpswapError, match="failed \\(RuntimeError: no such package\\)"):
        aoti.first_call_in_child(
            tmp_path / "p.pt2", tmp_path / "m.pt2", (torch.ones(1),), python=str(broken)
        )


def test_crash_frame_names_the_innermost_frame_faulthandler_printed() -> None:
    from opswap.backends.aoti import crash_frame

    stderr = (
        "some warning\n"
        "Fatal Python error: Segmentation fault\n\n"
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/opt/venv/lib/python3.12/site-packages/torch/_inductor/package/package.py", line 412 in load_package\n'
        '  File "/work/src/opswap/backends/aoti.py", line 90 in load\n'
    )
    assert crash_frame(stderr) == "load_package, torch/_inductor/package/package.py:412"
    assert crash_frame('Traceback (most recent call last):\n  File "x.py", line 1 in f\n') is None
    assert crash_frame("") is None


def test_a_crashing_child_is_named_with_its_frame(tmp_path) -> None:
    """A child killed by SIGSEGV: the error names the signal and the frame it died in."""
    import sys

    from opswap.backends.aoti import first_call_in_child
    from opswap.errors import OpswapError

    crasher = tmp_path / "crash.py"
    crasher.write_text("import ctypes\n\ndef boom():\n    ctypes.string_at(0)\n\nboom()\n")
    script = tmp_path / "py"  # stands in for the interpreter; ignores the child's arguments
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -X faulthandler {crasher}\n")
    script.chmod(0o755)
    with pytest.raises(
        OpswapError,
        match=r"crashed that process \(SIGSEGV, in string_at, .*ctypes/__init__\.py:\d+\)",
    ):
        first_call_in_child(
            tmp_path / "p.pt2", tmp_path / "m.pt2", (torch.zeros(1),), python=str(script)
        )
