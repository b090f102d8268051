import math

from onnx import helper


def _gelu(g, root=math.sqrt(2.0), grouping=0):
    nodes = [
        g.const("r", root),
        g.const("one", 1.0),
        g.const("half", 0.5),
        helper.make_node("Div", ["x", "r"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["one", "e"], ["b"]),
    ]
    if grouping == 0:  # 0.5 * x * (1 + erf): torch's legacy exporter
        nodes += [
            helper.make_node("Mul", ["x", "half"], ["m"]),
            helper.make_node("Mul", ["m", "b"], ["y"]),
        ]
    else:  # x * (0.5 * (1 + erf)): the dynamo exporter
        nodes += [
            helper.make_node("Mul", ["half", "b"], ["m"]),
            helper.make_node("Mul", ["x", "m"], ["y"]),
        ]
    return nodes


def test_erf_gelu_becomes_one_gelu_in_both_groupings(graphs):
    for grouping in (0, 1):
        m = graphs.load(_gelu(graphs, grouping=grouping), [("x", ["batch", 7, 5])], ["y"])
        plan, out, ops = graphs.apply(m, ["onnx.gelu"])
        assert plan.counts() == {"onnx.gelu": 1}
        assert ops.count("Gelu") == 1 and "Erf" not in ops
        assert graphs.matches(m, out, {"batch": 1}, {"batch": 4})


def test_a_wrong_scale_is_a_miss_with_its_reason(graphs):
    m = graphs.load(_gelu(graphs, root=1.5), [("x", ["batch", 7])], ["y"])
    plan, _, ops = graphs.apply(m, ["onnx.gelu"])
    assert not plan.sites and "Erf" in ops
    assert any("scaled by 1.5" in x.reason for x in plan.misses)
