"""path/to/model.pt2 saved by torch.export.save."""

from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch

from opswap.errors import SpecError
from opswap.graph import capture
from opswap.models import load


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    original = load("zoo:resnet", {"width": "8", "batch": "3", "image_size": "20"})
    program = torch.export.export(original.module, original.example_inputs)
    path = tmp_path_factory.mktemp("ckpt") / "resnet.pt2"
    torch.export.save(program, path)
    return original, path


def test_round_trip(saved):
    original, path = saved
    loaded = load(str(path))
    assert (loaded.source, loaded.name, loaded.spec) == ("checkpoint", "resnet", str(path))
    assert not loaded.module.training
    assert len(loaded.example_inputs) == 1
    torch.testing.assert_close(loaded.example_inputs[0], original.example_inputs[0])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 3, 20, 20, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(x), original.module(x))
    cap = capture(loaded.module, loaded.example_inputs)
    assert cap.method in ("fx", "export")


def test_overrides_are_refused(saved):
    _, path = saved
    with pytest.raises(SpecError, match="takes no overrides"):
        load(str(path), {"batch": "2"})


def test_missing_and_not_an_archive(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load(str(tmp_path / "absent.pt2"))
    bogus = tmp_path / "bogus.pt2"
    bogus.write_bytes(b"definitely not a zip archive")
    with pytest.raises(SpecError, match="not a torch.export archive"):
        load(str(bogus))


def _rewrite(src, dst, edit):
    """Copy a zip archive, passing each member through edit(name, data) -> data."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, edit(item.filename, zin.read(item.filename)))


def test_pickled_entries_are_refused(saved, tmp_path):
    _, path = saved

    def mark_pickled(name, data):
        if name.endswith("_weights_config.json"):
            table = json.loads(data)
            first = next(iter(table["config"]))
            table["config"][first]["use_pickle"] = True
            return json.dumps(table).encode()
        return data

    tampered = tmp_path / "tampered.pt2"
    _rewrite(path, tampered, mark_pickled)
    with pytest.raises(SpecError, match="cannot be loaded safely.*pickled object"):
        load(str(tampered))


def test_archive_without_program_is_refused(tmp_path):
    path = tmp_path / "empty.pt2"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x/data/weights/weight_0", b"\0" * 8)
    with pytest.raises(SpecError, match="holds no exported program"):
        load(str(path))


_OUTPUTS = """
import dataclasses, pathlib
import torch

pathlib.Path(__file__).with_name("imported.txt").write_text("the file's module was imported")


@dataclasses.dataclass
class Pair:
    low: torch.Tensor
    high: torch.Tensor
"""


def test_an_output_class_torch_cannot_read_back_is_named_and_not_imported(tmp_path):
    """A program returning a class pytree does not know in a fresh process: opswap never
    imports the module the file names; the error names the class, and, where torch's own
    load fails, torch's real cause rather than "check the warnings above"."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "pair_outputs.py").write_text(_OUTPUTS)
    sys.path.insert(0, str(tmp_path))
    try:
        import pair_outputs
    finally:
        sys.path.remove(str(tmp_path))
    (tmp_path / "imported.txt").unlink()
    torch.export.register_dataclass(pair_outputs.Pair, serialized_type_name="pair_outputs.Pair")

    class Split(torch.nn.Module):
        def forward(self, x):
            return pair_outputs.Pair(x.clamp(max=0), x.clamp(min=0))

    path = tmp_path / "pair.pt2"
    torch.export.save(torch.export.export(Split(), (torch.randn(2, 3),)), path)
    script = textwrap.dedent(f"""
        import opswap
        from opswap.models import checkpoint
        from opswap.errors import SpecError
        for skip_check in (False, True):
            if skip_check:
                checkpoint._register_tree_types = lambda path, types: None
            try:
                checkpoint.load_checkpoint({str(path)!r}, "pair.pt2", {{}})
            except SpecError as e:
                print(e)
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    ours, torchs = run.stdout.strip().splitlines()
    assert "returns pair_outputs.Pair" in ours and "import the module" in ours
    assert "pair_outputs.Pair" in torchs and "warnings above" not in torchs
    assert not (tmp_path / "imported.txt").exists()
