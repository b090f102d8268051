"""report.run_folder: a run written beside DIR and swapped in."""

from __future__ import annotations

import pytest

from opswap.errors import OpswapError
from opswap.report.run_folder import write_run


def _writer(**files):
    def write(folder):
        for name, text in files.items():
            (folder / name).write_text(text)
        return {name.split(".")[0]: folder / name for name in files}
    return write


def test_a_new_folder_gets_the_run_and_paths_point_into_it(tmp_path):
    out = tmp_path / "a" / "run"
    paths = write_run(out, _writer(**{"plan.json": "1", "model.pt2": "m"}))
    assert paths == {"plan": out / "plan.json", "model": out / "model.pt2"}
    assert sorted(p.name for p in out.iterdir()) == ["model.pt2", "plan.json"]
    assert [p.name for p in out.parent.iterdir()] == ["run"]


def test_an_earlier_runs_files_go_and_the_users_stay(tmp_path):
    out = tmp_path / "run"
    write_run(out, _writer(**{"model.pt2": "old", "model_shapes.txt": "n", "result.json": "o"}))
    (out / "notes.txt").write_text("mine")
    write_run(out, _writer(**{"model_state.pt": "new", "result.json": "r"}))
    assert sorted(p.name for p in out.iterdir()) == ["model_state.pt", "notes.txt", "result.json"]
    assert (out / "result.json").read_text() == "r" and (out / "notes.txt").read_text() == "mine"


def test_a_failed_write_changes_nothing(tmp_path):
    out = tmp_path / "run"
    write_run(out, _writer(**{"model.pt2": "old"}))

    def fails(folder):
        (folder / "model_state.pt").write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_run(out, fails)
    assert [p.name for p in out.iterdir()] == ["model.pt2"]
    assert (out / "model.pt2").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_file_in_the_folders_place_is_refused(tmp_path):
    (tmp_path / "run").write_text("a file")
    with pytest.raises(OpswapError, match="is a file"):
        write_run(tmp_path / "run", _writer(**{"plan.json": "1"}))

