"""Silence what native code writes to stderr while the profiler starts and stops.

Some torch builds print a `USDT ... profiler_start` line from C++ each time a
profiler session opens; it is not ours to show and drowns progress output.
Python-level writes to sys.stderr are not affected.
"""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def native_stderr_silenced():
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # pytest capture, notebooks: nothing to do
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            try:
                yield
            finally:
                os.dup2(saved, fd)
    finally:
        os.close(saved)
