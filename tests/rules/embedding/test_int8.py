"""embedding.int8: the tables of the bags (batched first) stored as int8 rows with scale
and bias, read by the dequantizing op; only at approx exactness; the memory before and
after in each site's description and record (a quarter plus 8 bytes a row); the numbers
within the rounding of int8 at other shapes."""

from __future__ import annotations

import pytest

from ._models import check_tables_shrink


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tables_shrink_and_say_by_how_much(method):
    check_tables_shrink(method, "embedding.int8", 4, 2e-2)
