import torch

from opswap.graph.dynamic import step_rows
from opswap.verify.samples import make_samples


def _example():
    img = torch.randn(2, 3, 9, 11) * 2.0 + 5.0
    ids = torch.randint(3, 17, (2, 13))
    mask = torch.rand(2, 13) > 0.3
    attn = torch.zeros(2, 13).masked_fill(torch.rand(2, 13) > 0.5, float("-inf"))
    return (img, ids, mask, attn, 7, "mean")


def test_shapes_dtypes_and_first_sample():
    ex = _example()
    samples = make_samples(ex, 4, seed=0)
    assert len(samples) == 4
    assert all(a is b for a, b in zip(samples[0], ex, strict=True))  # sample 0 is the example
    for s in samples[1:]:
        for new, old in zip(s, ex, strict=True):
            if isinstance(old, torch.Tensor):
                assert new.shape == old.shape and new.dtype == old.dtype
                assert new.device == old.device
            else:
                assert new == old
        assert not torch.equal(s[0], ex[0]) and not torch.equal(s[1], ex[1])


def test_floats_keep_scale_and_ints_stay_in_range():
    ex = _example()
    big = (torch.randn(64, 1000) * 3.0 - 2.0, torch.randint(5, 9, (4000,)))
    for s in make_samples(big, 3, seed=1)[1:]:
        assert abs(s[0].mean().item() + 2.0) < 0.1
        assert abs(s[0].std().item() - 3.0) < 0.1
        assert s[1].min().item() == 5 and s[1].max().item() == 8  # covers, never leaves [5, 8]
    for s in make_samples(ex, 5, seed=2)[1:]:
        assert s[1].min() >= ex[1].min() and s[1].max() <= ex[1].max()


def test_masks_and_bools_are_copied():
    ex = _example()
    for s in make_samples(ex, 3, seed=0)[1:]:
        assert torch.equal(s[2], ex[2])
        assert torch.equal(s[3], ex[3])  # a 0/-inf attention mask is structure, not data
        assert s[2] is not ex[2]


def test_deterministic_per_seed():
    ex = _example()
    a, b, c = (make_samples(ex, 3, seed=s) for s in (0, 0, 1))
    assert torch.equal(a[2][0], b[2][0])
    assert not torch.equal(a[2][0], c[2][0])
    assert not torch.equal(a[1][0], a[2][0])


def test_single_tensor_and_layout():
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    s = make_samples(x, 2, seed=0)
    assert s[0] == (x,)
    assert s[1][0].is_contiguous(memory_format=torch.channels_last)
    assert make_samples(x, 0) == []


def test_padding_masks_and_segments_get_new_run_lengths():
    keep = torch.tensor([[9], [6], [3], [1]])
    right = (torch.arange(9) < keep).long()  # attention mask, right padding: row 0 full
    left = right.flip(-1)
    types = (torch.arange(9) >= torch.tensor([[4], [3], [2], [1]])).long()  # two segments
    noise = torch.randint(0, 2, (4, 9))
    noise[0, :3] = torch.tensor([1, 0, 1])  # not one run of each
    ex = (right, left, types, noise)
    seen = set()
    for s in make_samples(ex, 6, seed=3)[1:]:
        new_right, new_left, new_types, new_noise = s
        for mask, side in ((new_right, "head"), (new_left, "tail")):
            assert mask.dtype == torch.int64 and set(mask.unique().tolist()) <= {0, 1}
            assert bool((mask.sum(1) >= 1).all())  # every row keeps a real token
            # still padding on the same side (or, by chance, no padding at all)
            assert step_rows(mask) == side or bool((mask == 1).all())
        assert bool((new_right[:, 0] == 1).all()) and bool((new_left[:, -1] == 1).all())
        ones = new_types.sum(1)
        assert bool(((ones >= 1) & (ones <= 8)).all())  # still two segments per row
        assert step_rows(new_types) == "tail"
        assert set(new_noise.unique().tolist()) == {0, 1}
        seen.add(tuple(new_right.sum(1).tolist()))
    assert len(seen) > 1  # new lengths, not the example's copied


def test_an_extreme_sample_is_large_and_on_request_non_finite_structure_kept():
    from opswap.verify.samples import extreme_sample

    ex = _example()
    ex = (ex[0].contiguous(memory_format=torch.channels_last), *ex[1:])
    big = extreme_sample(ex, scale=1e4, seed=1)
    img = big[0]
    assert img.shape == ex[0].shape and img.stride() == ex[0].stride()
    assert torch.isfinite(img).all()
    ratio = float(img.double().std() / ex[0].double().std())
    assert 5e3 < ratio < 2e4  # the example's spread, 1e4 times over
    assert torch.equal(big[1], ex[1]) and torch.equal(big[2], ex[2])  # ids, masks as they are
    assert torch.equal(big[3], ex[3]) and big[4:] == ex[4:]
    odd = extreme_sample(ex, nonfinite=True, seed=1)[0]
    flat = odd.reshape(-1)  # +inf, -inf and NaN, each once, in three different rows
    assert int(torch.isposinf(flat).sum()) == 1 and int(torch.isneginf(flat).sum()) == 1
    assert int(torch.isnan(flat).sum()) == 1
    rows = {
        int(i) // odd.shape[-1]
        for i in torch.nonzero(~torch.isfinite(odd.contiguous()).reshape(-1))
    }
    assert len(rows) == 3


def test_a_model_that_takes_large_and_non_finite_values_passes_on_the_extreme_sample():
    from opswap.graph.copies import private_copy
    from opswap.verify.outputs import verify
    from opswap.verify.samples import extreme_sample

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.ReLU()).eval()
    x = torch.randn(5, 12)
    sample = extreme_sample(x, nonfinite=True)
    v = verify(model, private_copy(model), x, variants=[("large and non-finite", sample)])
    assert v.passed and v.samples == 4  # NaN and inf where the model gives them agree
    copy = private_copy(model)

    def finite_only(t):  # the same model on finite inputs, numbers where it gave inf/NaN
        return torch.nan_to_num(copy(t))

    assert verify(model, finite_only, x).passed  # random samples never hold inf
    v = verify(model, finite_only, x, samples=1, variants=[("extreme", sample)])
    assert not v.passed and v.metrics.nonfinite > 0


def test_data_ranges_cover_float_inputs_and_clamped_holds_draws_inside():
    from opswap.verify.samples import clamped, data_ranges

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    mask = torch.ones(3, 7)  # structure, not data: left as it is
    batches = [(torch.rand(3, 7, generator=g) * 2 - 1, ids, mask) for _ in range(4)]
    ranges = data_ranges(batches)
    lo = min(float(b[0].min()) for b in batches)
    hi = max(float(b[0].max()) for b in batches)
    assert ranges == [(lo, hi), None, None]
    draw = make_samples(batches[0], 3, seed=5)[2]
    wide = (draw[0] * 10, draw[1], draw[2])  # far outside the data's range
    held = clamped(wide, ranges)
    assert float(held[0].min()) >= lo and float(held[0].max()) <= hi
    assert held[1] is wide[1] and held[2] is wide[2]
    inside = wide[0].clamp(lo, hi) == wide[0]
    assert torch.equal(held[0][inside], wide[0][inside])  # values in range are kept
