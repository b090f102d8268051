"""opswap::linear_cross_entropy and its backward: a training loss (with the gradients it
computes in the forward), which appears only in training graphs, and those are not
exported."""

from __future__ import annotations

from opswap.backends.lowerings._registry import TRAINING_ONLY, no_lowering

no_lowering("opswap::linear_cross_entropy", TRAINING_ONLY, __name__)
no_lowering("opswap::linear_cross_entropy_backward", TRAINING_ONLY, __name__)
