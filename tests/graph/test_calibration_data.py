"""graph.calibration_data: the forms calibration data comes in (a list of batches, a
stacked tensor cut at the example's batch size, .pt/.npy/.npz files) become input tuples
shaped like the example, converted to its dtypes; what does not fit is refused in one
sentence that names the batch and the input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opswap.errors import CalibrationError
from opswap.graph.calibration_data import batches, check_path, read_file

EXAMPLE = (torch.randn(5, 3, 7, 9),)


def test_a_list_of_tensors_and_a_list_of_tuples_are_batches():
    xs = [torch.randn(5, 3, 7, 9) for _ in range(3)]
    got = batches(xs, EXAMPLE, "test")
    assert len(got) == 3 and all(isinstance(b, tuple) and len(b) == 1 for b in got)
    assert all(torch.equal(b[0], x) for b, x in zip(got, xs, strict=True))
    two = (torch.randn(2, 11), torch.randint(0, 9, (2, 11)))
    pairs = [(torch.randn(3, 11), torch.randint(0, 9, (3, 11))) for _ in range(2)]
    got = batches(pairs, two, "test")
    assert [b[1].dtype for b in got] == [torch.int64, torch.int64]
    assert got[0][0].shape == (3, 11)  # another batch size is left to the run


def test_stacked_samples_are_cut_at_the_examples_batch_size():
    stacked = torch.randn(23, 3, 7, 9)
    got = batches(stacked, EXAMPLE, "test")
    assert [b[0].shape[0] for b in got] == [5, 5, 5, 5]  # 3 left over: dropped
    assert torch.equal(torch.cat([b[0] for b in got]), stacked[:20])
    small = batches(torch.randn(3, 3, 7, 9), EXAMPLE, "test")  # fewer than one batch
    assert len(small) == 1 and small[0][0].shape[0] == 3


def test_files_of_every_kind_read_alike(tmp_path):
    stacked = np.random.default_rng(0).standard_normal((12, 3, 7, 9))  # float64, as NumPy makes
    np.save(tmp_path / "s.npy", stacked)
    np.savez(tmp_path / "s.npz", x=stacked)
    torch.save(torch.from_numpy(stacked).float(), tmp_path / "s.pt")
    torch.save([(torch.from_numpy(stacked[i : i + 5]).float(),) for i in (0, 5)], tmp_path / "l.pt")
    want = torch.from_numpy(stacked[:10]).float()
    for name in ("s.npy", "s.npz", "s.pt", "l.pt"):
        got = batches(tmp_path / name, EXAMPLE, name)
        assert [b[0].dtype for b in got] == [torch.float32, torch.float32], name
        assert torch.allclose(torch.cat([b[0] for b in got]), want), name


def test_npz_holds_one_stacked_array_per_input_in_order(tmp_path):
    ids = np.arange(40).reshape(8, 5) % 7
    mask = np.ones((8, 5), dtype=np.int64)
    np.savez(tmp_path / "two.npz", ids=ids, mask=mask)
    example = (torch.zeros(4, 5, dtype=torch.int64), torch.ones(4, 5, dtype=torch.int64))
    got = batches(tmp_path / "two.npz", example, "two.npz")
    assert len(got) == 2 and torch.equal(got[1][0], torch.from_numpy(ids[4:]))


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ([], "holds no batch"),
        ({"x": torch.randn(5, 3, 7, 9)}, "is a dict; give a list of input batches"),
        ([(torch.randn(5, 3, 7, 9), torch.randn(5))], "batch 0 from test holds 2 inputs"),
        ([torch.randn(5, 3, 7, 9), torch.randn(5, 3, 7)], "batch 1, input 0, from test has shape"),
        ([torch.randint(0, 3, (5, 3, 7, 9))], "is int64, and the model's example is float32"),
        ([("not a tensor",)], "is a str, not a tensor"),
    ],
)
def test_what_does_not_fit_is_one_sentence(data, says):
    with pytest.raises(CalibrationError) as e:
        batches(data, EXAMPLE, "test")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_bad_files_are_refused_by_name(tmp_path):
    with pytest.raises(CalibrationError, match="No calibration file at"):
        check_path(tmp_path / "missing.pt")
    (tmp_path / "b.csv").write_text("1,2\n")
    with pytest.raises(CalibrationError, match="b.csv is not a calibration file"):
        check_path(tmp_path / "b.csv")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CalibrationError, match="Could not read calibration file junk.pt"):
        read_file(tmp_path / "junk.pt")
    stacked = np.zeros((6, 2)), np.zeros((5, 2))
    np.savez(tmp_path / "uneven.npz", *stacked)
    example = (torch.zeros(3, 2), torch.zeros(3, 2))
    with pytest.raises(CalibrationError, match="different numbers of samples"):
        batches(tmp_path / "uneven.npz", example, "uneven.npz")
