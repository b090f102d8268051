"""embedding.pruned (lossy): a 20 000-id table pruned to the rows its calibration samples
read (memory before and after in the record); ids the samples read keep their rows, unseen
ids share one and fine-tuning raises the agreement on them; refusals: no samples, ids that
are not a model input."""

from __future__ import annotations

from opswap.train.finetune_embedding import agreement, fine_tune

from ._models import Clicks, lossy, samples


def test_pruned_keeps_the_rows_read_and_fine_tuning_wins_back():
    m = Clicks(20_000).eval()
    data = samples(20, 2_000, 2)  # the samples read ~1 850 of 20 000 ids
    p, applied = lossy(m, "embedding.pruned", data, calibrate=True)
    (d,) = p.decisions
    rec = d.site.data
    assert 1_500 < rec["kept"] <= 2_000 and rec["bytes_after"] < rec["bytes_before"] / 4
    why = " | ".join(x.reason for x in p.misses)
    assert "not a model input" in why, why  # small(other % 500)
    seen = samples(4, 2_000, 3)
    assert agreement(m, applied.gm, seen) > 0.6  # ids the samples read keep their rows
    unseen = samples(4, 20_000, 4)
    before = agreement(m, applied.gm, unseen)
    fine_tune(applied.gm, m, unseen, steps=150)
    assert agreement(m, applied.gm, unseen) > before


def test_pruned_without_samples_says_so():
    m = Clicks(20_000).eval()
    p, _ = lossy(m, "embedding.pruned", samples(1, 2_000, 5))
    assert not p.decisions
    assert any("no sample inputs" in x.reason for x in p.misses), p.misses
