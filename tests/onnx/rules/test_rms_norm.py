from onnx import helper


def _rms(g, weight="w"):
    return [
        g.const("two", 2.0),
        g.const("eps", 1e-6),
        helper.make_node("Pow", ["x", "two"], ["x2"]),
        helper.make_node("ReduceMean", ["x2"], ["ms"], axes=[-1]),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["r"]),
        helper.make_node("Reciprocal", ["r"], ["ir"]),
        helper.make_node("Mul", ["x", "ir"], ["n"]),
        helper.make_node("Mul", ["n", weight], ["y"]),
    ]


def test_rms_norm_becomes_simplified_layer_norm(graphs):
    m = graphs.load(
        _rms(graphs), [("x", ["batch", "seq", 12])], ["y"], {"w": graphs.weight(12) + 1}, opset=13
    )
    plan, out, ops = graphs.apply(m, ["onnx.rms_norm"])
    assert plan.counts() == {"onnx.rms_norm": 1} and ops == ["SimplifiedLayerNormalization"]
    assert graphs.matches(m, out, {"batch": 1, "seq": 2}, {"batch": 2, "seq": 19})


def test_a_weight_that_is_an_input_is_a_miss(graphs):
    m = graphs.load(_rms(graphs), [("x", ["batch", 12]), ("w", [12])], ["y"], opset=13)
    plan, _, ops = graphs.apply(m, ["onnx.rms_norm"])
    assert "SimplifiedLayerNormalization" not in ops
    assert any("weight is not a constant" in x.reason for x in plan.misses)
