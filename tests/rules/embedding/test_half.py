"""embedding.half: the tables of the bags (batched first) stored as float16, read by the
dequantizing op; only at approx exactness; the memory halved, said in each site's
description and record; the numbers within float16's rounding."""

from __future__ import annotations

import pytest

from ._models import check_tables_shrink


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tables_shrink_and_say_by_how_much(method):
    check_tables_shrink(method, "embedding.half", 2, 1e-3)
