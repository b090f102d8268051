"""How much a low-precision model rounds on its own: the yardstick for "same math".

An exact rewrite of a float16 or bfloat16 model changes only the order of roundings,
so its outputs differ from the original's by about the original's own rounding
error. That error is measured once: the model in its dtype against a float32 copy
of itself on the same inputs. `Tolerance.at_rounding` turns it into thresholds.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.graph.copies import preserved_state, private_copy
from opswap.graph.inputs import fresh
from opswap.verify.metrics import combine, compare

LOW = (torch.float16, torch.bfloat16)


def low_precision(module: nn.Module) -> bool:
    """Whether the module computes in float16/bfloat16 (its floating parameters do)."""
    dts = {p.dtype for p in module.parameters() if p.is_floating_point()}
    dts |= {b.dtype for b in module.buffers() if b.is_floating_point()}
    return bool(dts & set(LOW))


def _outputs(out) -> list[torch.Tensor]:
    return [
        x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]


def own_rounding(module: nn.Module, inputs: tuple) -> float | None:
    """rel_l2 of the module's float outputs against a float32 copy of it, on `inputs`;
    None for a model that is not low precision or cannot run in float32."""
    if not isinstance(module, nn.Module) or not low_precision(module):
        return None

    def to32(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW else x

    try:
        wide = private_copy(module).float()
        with torch.no_grad(), preserved_state(module):
            low = _outputs(module(*fresh(inputs)))
        with torch.no_grad():
            ref = _outputs(wide(*tuple(pytree.tree_map(to32, list(fresh(inputs))))))
    except Exception:  # a model that hard-codes its dtype: no float32 twin to measure with
        return None
    if len(low) != len(ref) or not low:
        return None
    pairs = [compare(r, c) for r, c in zip(ref, low, strict=True) if r.shape == c.shape]
    return combine(pairs).rel_l2 if pairs else None
