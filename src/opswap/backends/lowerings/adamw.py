"""opswap::adamw: an optimizer's step, which runs only while training and is in no
exported graph."""

from __future__ import annotations

from opswap.backends.lowerings._registry import TRAINING_ONLY, no_lowering

no_lowering("opswap::adamw", TRAINING_ONLY, __name__)
