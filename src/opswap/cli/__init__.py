"""The `opswap` command: parses arguments, calls the Python API, prints.

Every command has --help; commands that produce data take --json PATH.
Errors opswap raises on purpose print as one line and exit with status 2; the
exit statuses are in EXIT_STATUS (shown by `opswap --help`).

The package has three parts: `app` (the typer set-up, the exit statuses and the error
handling), `commands` (a few lines per command, each calling one function of
opswap.api) and `render` (the tables and the text). The consoles live here, and the
commands load a spec through `opswap.cli._load`: both are looked up on this package
when used, so that a caller (a test, a program embedding the CLI) can replace them.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

# piped output (CI logs, files) gets a wide fixed width instead of rich's 80 columns,
# unless COLUMNS says otherwise
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)
err = Console(stderr=True)

from opswap.cli.app import EXIT_STATUS, app, main  # noqa: E402
from opswap.cli.commands import _load  # noqa: E402  (importing it registers the commands)

__all__ = ["EXIT_STATUS", "app", "console", "err", "main", "_load"]
