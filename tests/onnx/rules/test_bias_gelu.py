import numpy as np
from onnx import helper


def _model(g, bias):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Gelu", ["hb"], ["y"]),
    ]
    return g.load(
        nodes, [("x", ["batch", "seq", 4])], ["y"], {"w": g.weight(4, 6), "b": bias}, opset=20
    )


def test_bias_and_gelu_become_bias_gelu(graphs):
    m = _model(graphs, graphs.weight(6))
    plan, out, ops = graphs.apply(m, ["onnx.bias_gelu"])
    assert plan.counts() == {"onnx.bias_gelu": 1} and ops == ["MatMul", "BiasGelu"]
    assert graphs.matches(m, out, {"batch": 1, "seq": 2}, {"batch": 3, "seq": 9})


def test_a_two_dim_bias_is_a_miss(graphs):
    m = _model(graphs, graphs.weight(1, 6))
    plan, _, ops = graphs.apply(m, ["onnx.bias_gelu"])
    assert "BiasGelu" not in ops
    assert any("2 dims" in x.reason for x in plan.misses)


def test_the_tanh_gelu_is_not_taken_for_the_exact_one(graphs):
    nodes = [
        helper.make_node("Add", ["x", "b"], ["hb"]),
        helper.make_node("Gelu", ["hb"], ["y"], approximate="tanh"),
    ]
    m = graphs.load(nodes, [("x", ["batch", 6])], ["y"], {"b": np.ones(6, np.float32)}, opset=20)
    plan, _, ops = graphs.apply(m, ["onnx.bias_gelu"])
    assert "BiasGelu" not in ops and any("tanh approximation" in x.reason for x in plan.misses)
