from onnx import helper


def _model(g, dims):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["b", "h"], ["y"]),
    ]
    return g.load(nodes, [("x", dims)], ["y"], {"w": g.weight(6, 5), "b": g.weight(5)})


def test_two_dim_matmul_and_bias_become_gemm(graphs):
    m = _model(graphs, ["batch", 6])
    plan, out, ops = graphs.apply(m, ["onnx.matmul_bias"])
    assert plan.counts() == {"onnx.matmul_bias": 1} and ops == ["Gemm"]
    assert graphs.matches(m, out, {"batch": 1}, {"batch": 7})


def test_a_three_dim_input_is_a_miss(graphs):
    m = _model(graphs, ["batch", 3, 6])
    plan, _, ops = graphs.apply(m, ["onnx.matmul_bias"])
    assert ops == ["MatMul", "Add"]
    assert any("rank 3" in x.reason for x in plan.misses)
