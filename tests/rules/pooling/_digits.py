"""The digits net of opswap.train.finetune_pooling, trained once per test session."""

from __future__ import annotations

from functools import lru_cache

import pytest


@lru_cache(maxsize=1)
def net():
    pytest.importorskip("sklearn")
    from opswap.train.finetune_pooling import digits_pool_net

    return digits_pool_net()
