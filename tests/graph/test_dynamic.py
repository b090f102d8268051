"""Dynamic axes: detected from the inputs, probed on the model, overridable; probes make
shape propagation see which sizes move."""

import pytest
import torch
from torch import nn

from opswap.errors import CaptureError
from opswap.graph.capture import capture
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
    assert labels == ["batch 1", "batch 4", "seq 5"]
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
