"""`triton_op`: torch.library.triton_op, with its search for the Triton kernels inside an
op put off until something asks for them.

When an op is registered, torch 2.13's `triton_op` reads the source of the op's function
and, recursively, of every function it names (`torch._library.triton.
get_inner_triton_kernels`), to list the Triton kernels it launches. The list is read only
by AOTAutograd's cache, to put the kernels' source in its key. For opswap's 25 ops the
search parsed some 1500 functions' source and took 8 s of every `import opswap` on the
2-core VM (the CLI's start, each example, each test process: 8.5 s to import opswap
before, 3.6 s after), for a list most processes never read and that came out empty for
every opswap op (they launch their kernels through helpers the search does not follow).
Here the list is a `list` that runs the same search the first time it is iterated,
measured or indexed, so the cache key is what torch would compute, later.
A torch without the search (2.11) registers the op unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


class _Found(list):
    """The Triton kernels of `fn`, searched for on first use."""

    def __init__(self, fn: Callable[..., Any], search: Callable[[Callable[..., Any]], list]):
        super().__init__()
        self._fn, self._search, self._done = fn, search, False

    def _fill(self) -> None:
        if not self._done:
            self._done = True
            self.extend(self._search(self._fn))

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __len__(self) -> int:
        self._fill()
        return super().__len__()

    def __getitem__(self, i):
        self._fill()
        return super().__getitem__(i)

    def __contains__(self, x) -> bool:
        self._fill()
        return super().__contains__(x)

    def __repr__(self) -> str:
        self._fill()
        return super().__repr__()


@contextlib.contextmanager
def _lazy_search():
    lib = getattr(torch._library, "triton", None)
    search = getattr(lib, "get_inner_triton_kernels", None)
    if search is None:
        yield
        return
    lib.get_inner_triton_kernels = lambda fn: _Found(fn, search)
    try:
        yield
    finally:
        lib.get_inner_triton_kernels = search


#: each op's Python implementation by op name ("opswap::rms_norm"), for eager callers that
#: skip the dispatcher (backends.eager)
PYTHON: dict[str, Callable[..., Any]] = {}


def triton_op(name: str, *, mutates_args) -> Callable[[Callable[..., Any]], Any]:
    """`torch.library.triton_op(name, mutates_args=...)` as a decorator, registering the op
    now and searching for its kernels when first asked; the function is kept in `PYTHON`."""

    def dec(fn: Callable[..., Any]):
        PYTHON[name] = fn
        with _lazy_search():
            return torch.library.triton_op(name, mutates_args=mutates_args)(fn)

    return dec
