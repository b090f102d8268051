"""The `opswap` command: parses arguments, calls the Python API, prints.

Every command has --help; commands that produce data take --json PATH.
Errors opswap raises on purpose print as one line and exit with status 2; the
exit statuses are in EXIT_STATUS (shown by `opswap --help`).

The package has three parts: `app` (the typer set-up, the exit statuses and the error
handling), `commands` (a few lines per command, each calling one function of
opswap.api) and `render` (the tables and the text); `consoles` holds where it prints.
The consoles (`opswap.cli.consoles.console`, `.err`) and the spec loader
(`opswap.cli.commands._load`) are looked up when used, so that a caller (a test, a
program embedding the CLI) can replace them.
"""

from __future__ import annotations

from opswap.cli import run as _run  # noqa: F401  (importing it registers `optimize`)
from opswap.cli import serve as _serve  # noqa: F401  (registers `serve`, `bench-serve`)
from opswap.cli.app import EXIT_STATUS, app, main
from opswap.cli.commands import _load  # importing it registers the other commands
from opswap.cli.consoles import console, err

__all__ = ["EXIT_STATUS", "app", "console", "err", "main", "_load"]
