"""The measured tables shipped in the package (crossover.json, int4_tiles.json,
backward_launch.json): JSON files `{"about": ..., "entries": [...]}` that a GPU run
rewrites, its entries replacing those of the same key and the others kept."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any


def read_entries(path: Path, what: str, error: type[Exception]) -> list[dict[str, Any]]:
    """The entries of the table at `path` ([] where there is no file); a file that does not
    read as one raises `error`, naming `what` and how to mend it, in one sentence."""
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())["entries"]
        if not isinstance(entries, list):
            raise TypeError("its entries are not a list")
        return entries
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise error(
            f"the {what} {path} cannot be read ({e}); restore it from the package."
        ) from None


def merge_entries(
    path: Path,
    new: Iterable[dict[str, Any]],
    key: Callable[[dict[str, Any]], Hashable],
    about: str,
    what: str,
    error: type[Exception],
) -> None:
    """Rewrite the table at `path`: `new` replaces the entries of the same `key`, the others
    stay, all sorted by key."""
    keep = {key(e): e for e in read_entries(path, what, error)}
    keep.update({key(e): e for e in new})
    entries = [keep[k] for k in sorted(keep)]  # type: ignore[type-var]
    path.write_text(json.dumps({"about": about, "entries": entries}, indent=1) + "\n")
