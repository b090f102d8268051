import numpy as np
from onnx import helper

from opswap.onnx.load import InputSpec
from opswap.onnx.runtime import random_inputs, verify


def test_random_inputs_fit_ids_masks_and_floats():
    specs = [
        InputSpec("input_ids", "int64", ("batch", "seq")),
        InputSpec("attention_mask", "int64", ("batch", "seq")),
        InputSpec("token_type_ids", "int64", ("batch", "seq")),
        InputSpec("x", "float32", ("batch", 3)),
    ]
    got = random_inputs(specs, {"batch": 2, "seq": 5}, seed=0)
    assert got["input_ids"].shape == (2, 5) and got["input_ids"].max() < 64
    assert (got["attention_mask"] == 1).all() and set(np.unique(got["token_type_ids"])) <= {0, 1}
    assert got["x"].dtype == np.float32 and got["x"].std() > 0


def test_verify_fails_a_candidate_that_computes_something_else(graphs):
    m = graphs.load([helper.make_node("Relu", ["x"], ["y"])], [("x", ["batch", 4])], ["y"])
    wrong = graphs.proto([helper.make_node("Sigmoid", ["x"], ["y"])], [("x", ["batch", 4])], ["y"])
    check = verify(m, wrong, [m.sizes, {"batch": 1}])
    assert not check.passed and check.reasons and len(check.shapes) == 2
