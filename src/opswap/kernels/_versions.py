"""The version of a weight tensor, for caches of work done once per weight (packed layouts)."""

from __future__ import annotations

import torch


def version(t: torch.Tensor) -> int:
    """`t._version`, or -1 for a tensor made under torch.inference_mode (a model loaded
    there), which has no version counter: such weights are taken as never written after
    their first use."""
    return -1 if t.is_inference() else t._version
