import math

from onnx import helper


def _tanh_gelu(g, k=0.044715):
    return [
        g.const("three", 3.0),
        g.const("k", k),
        g.const("c", math.sqrt(2 / math.pi)),
        g.const("one", 1.0),
        g.const("half", 0.5),
        helper.make_node("Pow", ["x", "three"], ["p"]),
        helper.make_node("Mul", ["p", "k"], ["pk"]),
        helper.make_node("Add", ["x", "pk"], ["s"]),
        helper.make_node("Mul", ["s", "c"], ["sc"]),
        helper.make_node("Tanh", ["sc"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["b"]),
        helper.make_node("Mul", ["x", "half"], ["m"]),
        helper.make_node("Mul", ["m", "b"], ["y"]),
    ]


def test_gpt2_gelu_becomes_fast_gelu(graphs):
    m = graphs.load(_tanh_gelu(graphs), [("x", ["batch", "seq", 6])], ["y"])
    plan, out, ops = graphs.apply(m, ["onnx.fast_gelu"])
    assert plan.counts() == {"onnx.fast_gelu": 1} and ops == ["FastGelu"]
    assert graphs.matches(m, out, {"batch": 1, "seq": 3}, {"batch": 3, "seq": 11})


def test_onnx_gelu_tanh_becomes_fast_gelu(graphs):
    node = helper.make_node("Gelu", ["x"], ["y"], approximate="tanh")
    m = graphs.load([node], [("x", ["batch", 6])], ["y"], opset=20)
    plan, out, ops = graphs.apply(m, ["onnx.fast_gelu"])
    assert ops == ["FastGelu"]
    assert graphs.matches(m, out, {"batch": 5})


def test_another_coefficient_is_a_miss(graphs):
    m = graphs.load(_tanh_gelu(graphs, k=0.05), [("x", ["batch", 6])], ["y"])
    plan, _, ops = graphs.apply(m, ["onnx.fast_gelu"])
    assert not plan.sites and "Tanh" in ops
    assert any("0.05" in x.reason and "0.044715" in x.reason for x in plan.misses)
