"""What every benchmark script writes: its rows with the date, device and versions."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path

import torch


def write_results(out_dir: Path, name: str, device: str, rows: list, **extra) -> Path:
    """out_dir/name as JSON: date (UTC), device, torch and Python versions, `extra`, rows."""
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **extra,
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print("wrote", path)
    return path
