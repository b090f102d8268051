"""Loading what `opswap optimize --out DIR` saved, ready to run.

    import torch, opswap
    model = opswap.load_optimized("out/resnet")
    with torch.inference_mode():
        y = model(x)

DIR/model.pt2 is the variant that won the race (result.json's `deploy`), the very
file that was timed; opswap.artifact writes and loads it.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from opswap import artifact


def load_optimized(directory: str | Path, *, compile: bool | None = None) -> nn.Module:
    """The saved best variant of an optimize run in `directory` (or a model.pt2 path), as
    artifact.load gives it: `compile=None` follows the run (torch.compile when a compiled
    variant won); True / False force it on or off."""
    return artifact.load(directory, compile=compile)
