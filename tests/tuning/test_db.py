"""The tuning database: keys, near keys, two writers at once, a corrupt file set aside."""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import warnings
from pathlib import Path

import pytest

from opswap.errors import OpswapError
from opswap.tuning.db import (
    Key,
    TuningDB,
    TuningDBWarning,
    default_path,
    resolve_path,
    shape_distance,
)


def key(shapes=((2, 3, 17, 17), (8, 3, 3, 3)), versions="torch 2.x", kind="site-time") -> Key:
    return Key(kind, "conv(T0,T1)", shapes, "float32", "contiguous", "cpu: test", versions)


def test_put_get_and_exact_key(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    assert db.get(key()) is None
    assert db.put(key(), {"times": {"a": 1.5e-4}}, samples=12, noise=0.03)
    rec = db.get(key())
    assert rec is not None and rec.near is None
    assert rec.value == {"times": {"a": 1.5e-4}} and rec.samples == 12 and rec.noise == 0.03
    # a new connection (another run) reads what the first wrote
    again = TuningDB(tmp_path / "t.sqlite").get(key())
    assert again is not None and again.value == rec.value
    assert len(db) == 1 and [r.key for r in db.records("site-time")] == [key()]
    assert list(db.records("launch")) == []


def test_versions_and_kind_are_part_of_the_key(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    db.put(key(), 1.0)
    assert db.get(key(versions="torch 2.y")) is None  # an upgrade is a miss
    assert db.get(key(kind="verified-error")) is None
    with pytest.raises(OpswapError, match="kind"):
        key(kind="guess")


def test_near_key_reuses_the_nearest_record_within_the_bound(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    db.put(key(((2, 3, 17, 17), (8, 3, 3, 3))), "b2")
    db.put(key(((4, 3, 17, 17), (8, 3, 3, 3))), "b4")
    near = db.get(key(((3, 3, 17, 17), (8, 3, 3, 3))))  # log(3/2)=0.41 and log(4/3)=0.29
    assert near is None  # both further than NEAR_DISTANCE
    close = db.get(key(((5, 3, 17, 17), (8, 3, 3, 3))))  # log(5/4) = 0.22
    assert close is not None and close.value == "b4"
    assert close.near == pytest.approx(0.2231, abs=1e-3)
    assert close.key.shapes == ((4, 3, 17, 17), (8, 3, 3, 3))
    assert db.get(key(((5, 3, 17, 17), (8, 3, 3, 3))), near=False) is None
    loose = TuningDB(tmp_path / "t.sqlite", near_distance=0.5)
    hit = loose.get(key(((3, 3, 17, 17), (8, 3, 3, 3))))
    assert hit is not None and hit.value == "b4"  # the nearer of the two


def test_shape_distance() -> None:
    assert shape_distance(((2, 4),), ((2, 4),)) == 0
    assert shape_distance(((2, 4),), ((4, 2),)) == pytest.approx(2 * 0.6931, abs=1e-3)
    assert shape_distance(((2, 4),), ((2, 4, 1),)) == float("inf")
    assert shape_distance(((2, 4),), ((2, 4), (1,))) == float("inf")
    assert shape_distance(((0, 4),), ((1, 4),)) == float("inf")


def _writer(path: str, who: int, n: int) -> None:
    db = TuningDB(Path(path))
    for i in range(n):
        assert db.put(key(((who, i + 1, 5),)), {"who": who, "i": i})


def test_two_processes_write_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "t.sqlite")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, who, 60)) for who in (1, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningDBWarning)
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    db = TuningDB(Path(path))
    assert len(db) == 120
    rec = db.get(key(((2, 37, 5),)), near=False)
    assert rec is not None and rec.value == {"who": 2, "i": 36}


def test_garbage_file_is_set_aside_with_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    path.write_bytes(b"this is not a database, it is a shopping list\n" * 200)
    db = TuningDB(path)
    with pytest.warns(TuningDBWarning, match="unreadable") as caught:
        assert db.get(key()) is None
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    aside = list(tmp_path.glob("t.sqlite.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not")
    assert db.put(key(), 7) and db.get(key()) is not None  # a fresh one works


def test_truncated_file_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    db = TuningDB(path)
    for i in range(400):
        db.put(key(((i + 1, 3),)), {"pad": "x" * 200})
    db.close()
    # fold the WAL into the main file, then cut it in half
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    fresh = TuningDB(path)
    with pytest.warns(TuningDBWarning, match="moved to"):
        fresh.put(key(), 1)
    assert fresh.get(key()) is not None and len(fresh) == 1
    assert list(tmp_path.glob("t.sqlite.corrupt-*"))


def test_a_later_error_turns_it_off_without_a_crash(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    db.put(key(), 1)
    assert db._conn is not None
    db._conn.execute("DROP TABLE records")
    with pytest.warns(TuningDBWarning, match="times every measurement"):
        assert db.get(key()) is None
    assert not db.usable and db.put(key(), 2) is False


def test_where_the_file_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPSWAP_TUNING_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_path() == tmp_path / "cache" / "opswap" / "tuning.sqlite"
    monkeypatch.setenv("OPSWAP_TUNING_DB", str(tmp_path / "mine.sqlite"))
    assert default_path() == tmp_path / "mine.sqlite"
    assert resolve_path(None) == tmp_path / "mine.sqlite"
    assert resolve_path(str(tmp_path / "x.db")) == tmp_path / "x.db"
    monkeypatch.setenv("OPSWAP_TUNING_DB", "off")
    assert default_path() is None and resolve_path(None) is None
    assert resolve_path("off") is None
    with pytest.raises(OpswapError, match="is a directory"):
        resolve_path(str(tmp_path))


def test_the_suite_never_writes_the_real_cache() -> None:
    real = Path(os.path.expanduser("~")) / ".cache" / "opswap" / "tuning.sqlite"
    assert default_path() != real


def test_a_damaged_row_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    db.put(key(), {"times": {"a": 1.0}})
    db.put(key(((9, 9),)), 2)
    assert db._conn is not None
    db._conn.execute("UPDATE records SET value = '{not json' WHERE value = '2'")
    assert [r.value for r in db.records()] == [{"times": {"a": 1.0}}]  # the good row stays
    with pytest.warns(TuningDBWarning, match="could not be read"):
        assert db.get(key(((9, 9),))) is None
