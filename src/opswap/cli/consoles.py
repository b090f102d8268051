"""Where the CLI prints: `console` for results, `err` for errors and progress. Looked up
here when used, so that a caller (a test, a program embedding the CLI) can replace them."""

from __future__ import annotations

import os
import sys

from rich.console import Console

# piped output (CI logs, files) gets a wide fixed width instead of rich's 80 columns,
# unless COLUMNS says otherwise
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)
err = Console(stderr=True)
