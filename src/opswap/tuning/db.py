"""The tuning database: every measurement opswap makes, kept in one SQLite file.

A record is keyed by what the measurement depends on (`Key`: its kind, the op's
signature, the shapes, dtype and layout, the device and the versions of torch, Triton,
the driver and opswap) and holds a JSON value, when it was made, how many samples it
took and their spread. A run looks a measurement up before making it and writes it back
after, so a second run of the same model on the same machine times nothing.

Where the file lives: `--tuning-db PATH` (`OptimizeConfig.tuning_db`), else
`$OPSWAP_TUNING_DB`, else `$XDG_CACHE_HOME/opswap/tuning.sqlite` (`~/.cache/opswap/...`
without XDG_CACHE_HOME). `OPSWAP_TUNING_DB=off` turns it off.

Two processes may write at once: the file runs in WAL mode with a busy timeout, and each
write is one short transaction. A file that is not a database, or a damaged one, is
renamed aside (`tuning.sqlite.corrupt-<time>`) with a one-line warning and a fresh one
is made; an error while reading or writing later turns the database off for the run,
with one warning, and the run times as it would without one. Never a crash.

Near keys: with no record for a key, the nearest record of the same kind, op signature,
dtype, layout, device and versions is reused when its shapes are within `NEAR_DISTANCE`
by `shape_distance` (the sum over every dimension of |log(a / b)|: 0.25 lets one size
differ by about 28%), and the lookup says it was near and which shapes it used.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from opswap.errors import OpswapError

#: bumped when the table's columns change; a file of another version is set aside
SCHEMA_VERSION = 1
#: the furthest shape_distance a near key may be from the one asked for
NEAR_DISTANCE = 0.25
#: ms a writer waits for another process's write to finish before giving up
BUSY_TIMEOUT_MS = 10_000
#: what OPSWAP_TUNING_DB (or a path) may say to turn the database off
OFF_WORDS = frozenset({"off", "none", "no", "0", "false"})

Kind = Literal["site-time", "launch", "verified-error", "plan-time"]
KINDS: tuple[str, ...] = ("site-time", "launch", "verified-error", "plan-time")
Shapes = tuple[tuple[int, ...], ...]


class TuningDBWarning(UserWarning):
    """The tuning database could not be used as it was (set aside, or turned off)."""


def default_path() -> Path | None:
    """$OPSWAP_TUNING_DB, else the user's cache dir's opswap/tuning.sqlite; None when
    OPSWAP_TUNING_DB turns it off."""
    env = os.environ.get("OPSWAP_TUNING_DB", "").strip()
    if env:
        return None if env.lower() in OFF_WORDS else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "opswap" / "tuning.sqlite"


def resolve_path(setting: str | None) -> Path | None:
    """The file a run's `tuning_db` setting names: a path, an off word (None), or None for
    the default (default_path). A path that is a directory is refused in one sentence."""
    if setting is None:
        return default_path()
    if setting.strip().lower() in OFF_WORDS:
        return None
    path = Path(setting).expanduser()
    if path.is_dir():
        raise OpswapError(
            f"--tuning-db {setting} is a directory; name a file in it, such as "
            f"{path / 'tuning.sqlite'}."
        )
    return path


@dataclass(frozen=True)
class Key:
    """What a measurement depends on. `op` is the op's signature without its sizes (the
    sizes are `shapes`), `device` names the machine's chip (and a CPU's thread count),
    `versions` the software (torch, Triton, the driver, opswap)."""

    kind: str
    op: str
    shapes: Shapes
    dtype: str
    layout: str
    device: str
    versions: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise OpswapError(f"A tuning record's kind must be one of {', '.join(KINDS)}.")

    def digest(self) -> str:
        """The row's primary key: every field, as JSON."""
        return json.dumps(
            [
                self.kind,
                self.op,
                [list(s) for s in self.shapes],
                self.dtype,
                self.layout,
                self.device,
                self.versions,
            ],
            separators=(",", ":"),
        )


@dataclass(frozen=True)
class Record:
    """A stored measurement. `shapes` are the record's own (a near hit's differ from those
    asked for); `near` is the shape distance when it was found by a near key, else None."""

    key: Key
    value: Any
    created: float
    samples: int
    noise: float | None
    near: float | None = None


def shape_distance(a: Shapes, b: Shapes) -> float:
    """Sum over every dimension of |log(a / b)|; inf when the shapes differ in number or
    rank, or a dimension is 0 in one and not the other."""
    if len(a) != len(b):
        return math.inf
    total = 0.0
    for sa, sb in zip(a, b, strict=True):
        if len(sa) != len(sb):
            return math.inf
        for x, y in zip(sa, sb, strict=True):
            if x == y:
                continue
            if x <= 0 or y <= 0:
                return math.inf
            total += abs(math.log(x / y))
    return total


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    key TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    op TEXT NOT NULL,
    shapes TEXT NOT NULL,
    dtype TEXT NOT NULL,
    layout TEXT NOT NULL,
    device TEXT NOT NULL,
    versions TEXT NOT NULL,
    value TEXT NOT NULL,
    created REAL NOT NULL,
    samples INTEGER NOT NULL,
    noise REAL
);
CREATE INDEX IF NOT EXISTS records_near ON records (kind, op, dtype, layout, device, versions);
"""


class _Corrupt(Exception):
    pass


@dataclass
class TuningDB:
    """One tuning database file, opened (and made) on first use.

    >>> db = TuningDB(tmp_path / "tuning.sqlite")
    >>> db.put(key, {"pytorch": 1.2e-4})
    >>> db.get(key).value
    """

    path: Path
    near_distance: float = NEAR_DISTANCE
    _conn: sqlite3.Connection | None = field(default=None, init=False, repr=False)
    #: False once an error turned the database off for this process
    usable: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    # opening ---------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection | None:
        if self._conn is not None or not self.usable:
            return self._conn
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._conn = self._open()
            except _Corrupt as e:
                self._set_aside(str(e))
                self._conn = self._open()
        except (OSError, sqlite3.Error, _Corrupt) as e:
            self._off(f"cannot be opened ({e})")
        return self._conn

    def _open(self) -> sqlite3.Connection:
        """A connection to a file with this schema; _Corrupt when the file is not one."""
        conn = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_MS / 1e3, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if conn.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise _Corrupt("its pages fail SQLite's quick_check")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(_SCHEMA)  # IF NOT EXISTS: a second process's is a no-op
            conn.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
            row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            if row is None or row[0] != str(SCHEMA_VERSION):
                raise _Corrupt(f"it has schema version {row and row[0]}, not {SCHEMA_VERSION}")
            return conn
        except sqlite3.DatabaseError as e:
            conn.close()
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise
            raise _Corrupt(str(e)) from None
        except _Corrupt:
            conn.close()
            raise

    def _set_aside(self, why: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        self.path.replace(aside)
        for suffix in ("-wal", "-shm"):
            extra = self.path.with_name(self.path.name + suffix)
            if extra.exists():
                extra.replace(aside.with_name(aside.name + suffix))
        warnings.warn(
            f"The tuning database {self.path} was unreadable ({why}); it was moved to "
            f"{aside.name} and a new one made.",
            TuningDBWarning,
            stacklevel=4,
        )

    def _off(self, why: str) -> None:
        self.usable = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        warnings.warn(
            f"The tuning database {self.path} {why}; this run times every measurement.",
            TuningDBWarning,
            stacklevel=4,
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # reading and writing ---------------------------------------------------------------

    def get(self, key: Key, near: bool = True) -> Record | None:
        """The record of `key`; without one (and with `near`), the nearest record within
        `near_distance` of its shapes (Record.near says how far); else None."""
        conn = self._connect()
        if conn is None:
            return None
        try:
            row = conn.execute(
                "SELECT shapes, value, created, samples, noise FROM records WHERE key = ?",
                (key.digest(),),
            ).fetchone()
            if row is not None:
                return self._record(key, row, None)
            if not near:
                return None
            rows = conn.execute(
                "SELECT shapes, value, created, samples, noise FROM records WHERE kind = ? "
                "AND op = ? AND dtype = ? AND layout = ? AND device = ? AND versions = ?",
                (key.kind, key.op, key.dtype, key.layout, key.device, key.versions),
            ).fetchall()
        except (sqlite3.Error, ValueError, TypeError) as e:
            self._off(f"could not be read ({e})")
            return None
        try:
            best: tuple[float, Any] | None = None
            for r in rows:
                d = shape_distance(key.shapes, _shapes(r[0]))
                if d <= self.near_distance and (best is None or d < best[0]):
                    best = (d, r)
            return None if best is None else self._record(key, best[1], best[0])
        except (ValueError, TypeError) as e:  # a row whose JSON was damaged
            self._off(f"holds a damaged record ({e})")
            return None

    @staticmethod
    def _record(key: Key, row: Sequence[Any], near: float | None) -> Record:
        shapes = _shapes(row[0])
        own = Key(key.kind, key.op, shapes, key.dtype, key.layout, key.device, key.versions)
        return Record(own, json.loads(row[1]), row[2], row[3], row[4], near)

    def put(self, key: Key, value: Any, samples: int = 1, noise: float | None = None) -> bool:
        """Write (or replace) the record of `key`; False when the database is off."""
        conn = self._connect()
        if conn is None:
            return False
        try:
            conn.execute(
                "INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key.digest(),
                    key.kind,
                    key.op,
                    json.dumps([list(s) for s in key.shapes]),
                    key.dtype,
                    key.layout,
                    key.device,
                    key.versions,
                    json.dumps(value),
                    time.time(),
                    int(samples),
                    noise,
                ),
            )
        except sqlite3.Error as e:
            self._off(f"could not be written ({e})")
            return False
        return True

    def records(self, kind: str | None = None) -> Iterator[Record]:
        """Every record (of `kind`), oldest first."""
        conn = self._connect()
        if conn is None:
            return
        sql = "SELECT kind, op, shapes, dtype, layout, device, versions, value, created, "
        sql += "samples, noise FROM records"
        try:
            rows = (
                conn.execute(sql + " WHERE kind = ? ORDER BY created", (kind,)).fetchall()
                if kind is not None
                else conn.execute(sql + " ORDER BY created").fetchall()
            )
        except sqlite3.Error as e:
            self._off(f"could not be read ({e})")
            return
        for r in rows:
            try:
                key = Key(r[0], r[1], _shapes(r[2]), r[3], r[4], r[5], r[6])
                yield Record(key, json.loads(r[7]), r[8], r[9], r[10])
            except (ValueError, TypeError, OpswapError):
                continue  # a damaged row: the others are still good

    def __len__(self) -> int:
        conn = self._connect()
        if conn is None:
            return 0
        try:
            return int(conn.execute("SELECT COUNT(*) FROM records").fetchone()[0])
        except sqlite3.Error:
            return 0


def _shapes(text: str) -> Shapes:
    return tuple(tuple(int(d) for d in s) for s in json.loads(text))
