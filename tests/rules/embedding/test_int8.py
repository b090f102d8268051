"""embedding.int8 and embedding.half: the tables of the bags (batched first) stored as int8
rows with scale and bias, or float16, read by the dequantizing op; only at approx
exactness; the memory before and after in each site's description and record (int8: a
quarter plus 8 bytes a row; float16: half); the numbers within the rounding of the stored
dtype at other shapes."""

from __future__ import annotations

import pytest

from ._models import Tables, fired, inputs, plan

BAGS = ["embedding.bag", "embedding.batched"]


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize(
    ("rule", "ratio", "rel"), [("embedding.int8", 4, 2e-2), ("embedding.half", 2, 1e-3)]
)
def test_tables_shrink_and_say_by_how_much(method, rule, ratio, rel):
    m = Tables().eval()
    p, applied = plan(m, inputs(), [*BAGS, rule], method, exactness="approx", rel=rel)
    got = fired(p, rule)
    assert len(got) == 3, (p.decisions, p.misses)  # the batched group, weighted, mean
    for d in got:
        rec = d.site.data
        extra = 8 * rec["rows"] if ratio == 4 else 0
        assert rec["bytes_after"] == rec["bytes_before"] // ratio + extra, rec
        assert " -> " in d.site.description and "float32" in d.site.description
