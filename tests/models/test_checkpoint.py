"""path/to/model.pt2 saved by torch.export.save."""

from __future__ import annotations

import json
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
