"""Every example script runs to the end (one per chapter; see examples/)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("ch*.py"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(script, tmp_path):
    env = {**os.environ, "OPSWAP_CACHE_DIR": os.environ.get("OPSWAP_CACHE_DIR", str(tmp_path))}
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip(), "an example should say what it did"


def test_the_example_model_file_loads_as_a_spec():
    """examples/models/*.py are user-style model files (`file.py:build` specs)."""
    from opswap.models import load

    spec = str(Path(__file__).resolve().parent.parent / "examples/models/small_cnn.py") + ":build"
    m = load(spec, overrides={"batch": "3", "width": "8"})
    (x,) = m.example_inputs
    assert tuple(x.shape) == (3, 3, 32, 32) and not m.module.training
    bn = m.module.features[1]
    assert not torch.allclose(
        bn.running_var, torch.ones_like(bn.running_var)
    )  # folds change numbers
    assert m.module(x).shape == (3, 10)
