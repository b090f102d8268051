"""Inductor's and AOTAutograd's on-disk caches, keyed on opswap's kernels too.

Those caches key a compiled graph on the graph, torch's version and Inductor's settings,
not on the fake kernels of the custom ops in it. A graph compiled with an older fake
kernel (say conv_relu's, before it gave the real strides for a one-channel input) is
found again after opswap changes, with the old strides in its `assert_size_stride`, and
the crash outlives the fix. `KernelsKey` is a post-grad pass that does nothing and whose
uuid, which the caches put in their keys, is a digest of opswap's kernel sources; the
compiles opswap runs set it (`inductor_options`).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from torch._inductor.custom_graph_pass import CustomGraphPass

_KERNELS = Path(__file__).resolve().parent


@functools.cache
def digest(root: Path = _KERNELS) -> str:
    """sha256 over the names and bytes of every .py file under `root`."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class KernelsKey(CustomGraphPass):
    """A post-grad pass that changes nothing; its uuid is `digest()`."""

    def __call__(self, graph: Any) -> None:
        return None

    def uuid(self) -> str:
        return digest()


def inductor_options(config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Inductor settings for a compile of a graph that may hold opswap's ops: `config` with
    KernelsKey as the post-grad custom pass, unless `config` or Inductor's global settings
    already name one (a user's pass, which then keys the caches by its own uuid)."""
    from torch._inductor import config as inductor_config

    out = dict(config or {})
    if out.get("post_grad_custom_post_pass") is None and (
        inductor_config.post_grad_custom_post_pass is None
    ):
        out["post_grad_custom_post_pass"] = KernelsKey()
    return out
