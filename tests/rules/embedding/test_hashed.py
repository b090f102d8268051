"""embedding.hashed (lossy): a 100 000-id table hashed into 25 000 rows (a quarter of the
bytes, in the record), a 500-id table refused as too small; the top-1 agreement with the
original on sample ids before and after fine-tuning (fine-tuning raises it)."""

from __future__ import annotations

from opswap.train.finetune_embedding import agreement, fine_tune

from ._models import Clicks, lossy, samples


def test_hashed_quarter_table_and_fine_tuning_wins_back():
    m = Clicks(100_000).eval()
    data = samples(8, 100_000, 1)
    p, applied = lossy(m, "embedding.hashed", data)
    (d,) = p.decisions
    rec = d.site.data
    assert rec["buckets"] == 25_000 and rec["bytes_after"] * 4 == rec["bytes_before"]
    why = " | ".join(x.reason for x in p.misses)
    assert "fewer than the 100000 worth hashing" in why, why  # the small table
    before = agreement(m, applied.gm, data)
    fine_tune(applied.gm, m, data, steps=150)
    after = agreement(m, applied.gm, data)
    assert before < 1.0 and after > before, (before, after)
