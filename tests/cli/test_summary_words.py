"""The CLI's summary names a dynamic axis by its inputs' names and dims, in words."""

from opswap.cli.run import _where


def test_an_axis_is_named_by_its_inputs_and_dims():
    axis = {"name": "seq", "inputs": ["input 0 dim 1", "input 1 dim 1"]}
    assert _where(axis, ["input_ids", "attention_mask"]) == "dim 1 of input_ids and attention_mask"
    image = {"name": "dim0_2", "inputs": ["input 0 dim 2", "input 0 dim 3"]}
    assert _where(image, ["x"]) == "dim 2 of x; dim 3 of x"
    assert _where({"inputs": ["input 3 dim 0"]}, ["x"]) == "dim 0 of input 3"
