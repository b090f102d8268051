"""Dynamic axes: detected from the inputs, probed on the model, overridable; probes make
shape propagation see which sizes move."""

import pytest
import torch
from torch import nn

from opswap.api import capture
from opswap.errors import CaptureError
from opswap.graph.dynamic import at, detect, export_shapes, parse, step_rows, variants
from opswap.graph.shapes import dynamic_dims, shapes_seen


class Text(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)

    def forward(self, ids, mask):
        return self.emb(ids) * mask.unsqueeze(-1)


def _text(b=2, s=7):
    ids = torch.randint(0, 50, (b, s))
    mask = torch.ones(b, s)
    mask[0, -2:] = 0  # padding
    return ids, mask


def test_auto_finds_batch_and_sequence():
    axes = dict(parse("auto", _text()))
    assert axes == {"batch": ((0, 0), (1, 0)), "seq": ((0, 1), (1, 1))}
    assert dict(parse("auto", (torch.randn(5),))) == {}  # a lone vector has no batch
    assert dict(parse("auto", (torch.randn(2, 3, 8, 8),))) == {"batch": ((0, 0),)}
    assert parse("none", _text()) == []
    assert dict(parse("0:1=time", (torch.randn(2, 9),))) == {"time": ((0, 1),)}


@pytest.mark.parametrize("bad", ["sideways", "0:5", "3:0", "0:"])
def test_bad_setting_is_one_sentence(bad):
    with pytest.raises(CaptureError, match="dynamic"):
        parse(bad, (torch.randn(2, 3),))


def test_probe_drops_an_axis_the_model_cannot_follow():
    class Fixed(nn.Module):
        def forward(self, x):
            return x.view(2, 6)  # batch 2 only

    dyn = detect(lambda xs: Fixed()(*xs), (torch.randn(2, 6),))
    assert dyn.axes == []
    assert "batch kept static" in dyn.notes[0] and "batch 1" in dyn.notes[0]


def test_variants_keep_structure_and_cover_batch_one():
    inputs = _text(b=3, s=6)
    dyn = detect(lambda xs: Text()(*xs), inputs)
    labels = [label for label, _ in variants(inputs, dyn)]
    # the sequence's large end (4x the example) is checked too, at batch 1
    assert labels == ["batch 1", "batch 4", "seq 5", "seq 24 (largest verified), batch 1"]
    ids, mask = at(inputs, dyn.axis("batch"), 5)
    assert ids.shape == (5, 6) and mask.shape == (5, 6)
    assert torch.equal(ids[:3], inputs[0]) and torch.equal(ids[4], inputs[0][2])
    assert export_shapes(inputs, dyn)[0].keys() == {0, 1}


def test_shape_propagation_marks_moving_sizes():
    class Net(nn.Module):
        def forward(self, ids, mask):
            h = Text()(ids, mask)
            return h.flatten(1), h.sum(1)

    inputs = _text()
    c = capture(Net(), inputs)
    assert [a.name for a in c.dynamic.axes] == ["batch", "seq"]
    flat = next(n for n in c.gm.graph.nodes if n.name.startswith("flatten"))
    assert dynamic_dims(flat) == {0, 1}  # batch, and seq * 8
    assert len(shapes_seen(flat)) == 3  # the example and two probes


def test_export_capture_keeps_sizes_symbolic():
    c = capture(Text(), _text(), method="export")
    assert [a.name for a in c.dynamic.axes] == ["batch", "seq"]
    with torch.no_grad():
        out = c.gm(*_text(b=5, s=3))
    assert out.shape == (5, 3, 8)


def test_export_of_batch_one_keeps_batch_static_and_says_why():
    c = capture(Text(), _text(b=1), method="export")
    assert "batch" not in [a.name for a in c.dynamic.axes]
    assert any("size-1" in n for n in c.notes)


def _masks():
    keep = torch.tensor([[6], [4], [1]])
    right = (torch.arange(6) < keep).long()  # ones, then padding
    return right, right.flip(-1)  # and the same rows padded on the left


def test_step_rows_tells_padding_sides():
    right, left = _masks()
    assert step_rows(right) == "head" and step_rows(left) == "tail"
    assert step_rows(right.bool()) == "head"
    assert step_rows(torch.zeros(3, 6).masked_fill(right == 0, float("-inf"))) == "head"
    assert step_rows(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])) == "tail"  # token types
    assert step_rows(torch.tensor([[1, 0, 1, 0]])) is None
    assert step_rows(torch.tensor([[3, 7, 7], [9, 1, 2]])) is None  # token ids
    assert step_rows(torch.ones(3, 6)) is None and step_rows(right[0]) is None


def test_resizing_a_padding_mask_keeps_every_row_valid():
    right, left = _masks()
    ids = torch.randint(0, 50, (3, 6))
    dyn = detect(lambda xs: Text()(xs[0], xs[1].float()), (ids, right))
    seq = dyn.axis("seq")
    for mask, side in ((right, "head"), (left, "tail")):
        for n in (2, 5, 9):
            _, cut = at((ids, mask), seq, n)
            assert cut.shape == (3, n) and set(cut.unique().tolist()) <= {0, 1}
            assert bool((cut.sum(1) >= 1).all()), (side, n)  # a row never loses all its ones
            assert step_rows(cut) == side or bool((cut == 1).all())
        _, cut = at((ids, mask), seq, 2)
        # left padding is cut from the front, so the shortest row keeps its one token
        assert cut[2].tolist() == ([1, 0] if side == "head" else [0, 1])
    _, more = at((ids, right), dyn.axis("batch"), 5)
    assert torch.equal(more[3], right[2]) and torch.equal(more[4], right[2])


# ------------------------------------------------------- every dim probed, static ones refused

QUICK = dict(bench=False, layers=False, measure_rules=False)


class Frames(nn.Module):
    """(batch, time, features): any time length, features fixed by the Linear."""

    def __init__(self, norm=(16,)):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.norm = nn.LayerNorm(norm)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(self.fc(x))
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return torch.relu(self.norm(h))


def _trained(m):
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_time_dim_of_a_float_input_stays_symbolic(tmp_path):
    import opswap
    from opswap.config import OptimizeConfig
    from opswap.errors import InputError
    from opswap.pipeline import optimize

    m = _trained(Frames())
    x = torch.randn(2, 10, 16)
    dyn = detect(lambda xs: m(*xs), (x,))
    assert {a.dims for a in dyn.axes} == {((0, 0),), ((0, 1),)}
    assert any("input 0 dim 2 (16)" in n for n in dyn.notes)  # the features: refused
    r = optimize(m, (x,), OptimizeConfig(**QUICK))
    assert r.verification.passed and r.applied
    assert "dim0_1 11" in r.verification.shapes  # verified at another length
    r.save(tmp_path)
    loaded = opswap.load_optimized(tmp_path)
    with torch.no_grad():
        for xs in (torch.randn(3, 7, 16), torch.randn(1, 23, 16)):
            _close(r.candidate(xs), m(xs))
            _close(loaded(xs), m(xs))
        with pytest.raises(InputError, match="size 16 in dim 2.*got \\(2, 10, 12\\)"):
            r.candidate(torch.randn(2, 10, 12))


def test_a_size_the_model_fixes_is_refused_in_one_sentence(tmp_path):
    import opswap
    from opswap.config import OptimizeConfig
    from opswap.errors import InputError
    from opswap.pipeline import optimize

    m = _trained(Frames(norm=(10, 16)))  # normalises over time and features: time is fixed
    x = torch.randn(2, 10, 16)
    r = optimize(m, (x,), OptimizeConfig(**QUICK))
    assert [a.dims for a in r.dynamic.axes] == [((0, 0),)]
    with torch.no_grad():
        y = torch.randn(5, 10, 16)
        _close(r.candidate(y), m(y))  # another batch runs
        with pytest.raises(InputError) as e:
            r.candidate(torch.randn(2, 7, 16))
    assert "size 10 in dim 1" in str(e.value) and "\n" not in str(e.value)
    r.save(tmp_path)
    with pytest.raises(ValueError, match="size 10 in dim 1"):
        opswap.load_optimized(tmp_path)(torch.randn(2, 7, 16))


class UNet(nn.Module):
    """Two poolings and two upsamplings with skips: only multiples of 4 run."""

    def __init__(self):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(nn.functional.max_pool2d(a, 2))
        c = self.mid(nn.functional.max_pool2d(b, 2))
        b = b + nn.functional.interpolate(c, scale_factor=2.0)
        a = a + nn.functional.interpolate(b, scale_factor=2.0)
        return self.out(a)


def test_sizes_that_must_be_multiples_are_probed_at_a_step_the_model_takes():
    from opswap.config import OptimizeConfig
    from opswap.pipeline import optimize

    m = UNet().eval()
    x = torch.randn(2, 3, 12, 12)  # 12 = 4 * 3: +1 fails, the step of 4 runs
    dyn = detect(lambda xs: m(*xs), (x,))
    spatial = next(a for a in dyn.axes if a.dims == ((0, 2), (0, 3)))
    assert spatial.step == 4 and spatial.probe == 16
    r = optimize(m, (x,), OptimizeConfig(**QUICK))
    assert r.verification.passed and "dim0_2 16" in r.verification.shapes
    with torch.no_grad():
        y = torch.randn(1, 3, 20, 20)
        _close(r.candidate(y), m(y))
    # the step can be named too
    named = detect(lambda xs: m(*xs), (x,), "0:2=h%8,0:3=h%8")
    assert [(a.name, a.step, a.probe) for a in named.axes] == [("h", 8, 20)]


def test_a_bad_step_is_one_sentence():
    with pytest.raises(CaptureError, match="INPUT:DIM"):
        parse("0:1=t%0", _text())
