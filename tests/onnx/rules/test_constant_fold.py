import numpy as np
from onnx import helper


def test_constant_subgraphs_are_computed_ahead(graphs):
    """A weight transposed and scaled at run time, as some exporters leave it."""
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        graphs.const("two", 2.0),
        helper.make_node("Mul", ["wt", "two"], ["w2"]),
        helper.make_node("MatMul", ["x", "w2"], ["y"]),
    ]
    m = graphs.load(nodes, [("x", ["batch", 3])], ["y"], {"w": graphs.weight(4, 3)})
    plan, out, ops = graphs.apply(m, ["onnx.constant_fold"])
    assert ops == ["MatMul"]
    assert set(plan.sites[0].nodes) >= {"Transpose_0", "Mul_2"}
    assert graphs.matches(m, out, {"batch": 1}, {"batch": 6})


def test_nothing_to_fold_leaves_the_model_alone(graphs):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = graphs.load(nodes, [("x", ["batch", 3])], ["y"], {"w": np.ones((3, 2), np.float32)})
    plan, _, ops = graphs.apply(m, ["onnx.constant_fold"])
    assert not plan.sites and ops == ["MatMul"]
