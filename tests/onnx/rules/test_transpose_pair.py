from onnx import helper


def _pair(p, q):
    return [
        helper.make_node("Transpose", ["x"], ["t"], perm=p),
        helper.make_node("Transpose", ["t"], ["u"], perm=q),
        helper.make_node("Relu", ["u"], ["y"]),
    ]


def test_transposes_that_cancel_are_dropped(graphs):
    m = graphs.load(_pair([0, 2, 1, 3], [0, 2, 1, 3]), [("x", ["batch", 3, 4, 5])], ["y"])
    plan, out, ops = graphs.apply(m, ["onnx.transpose_pair"])
    assert plan.counts() == {"onnx.transpose_pair": 1} and ops == ["Relu"]
    assert graphs.matches(m, out, {"batch": 1}, {"batch": 4})


def test_two_transposes_compose_into_one(graphs):
    """Attention's key: transpose(1, 2) then transpose(2, 3) is perm [0, 2, 3, 1]."""
    m = graphs.load(_pair([0, 2, 1, 3], [0, 1, 3, 2]), [("x", ["batch", 3, 4, 5])], ["y"])
    plan, out, ops = graphs.apply(m, ["onnx.transpose_pair"])
    assert ops == ["Transpose", "Relu"]
    assert list(out.graph.node[0].attribute[0].ints) == [0, 2, 3, 1]
    assert graphs.matches(m, out, {"batch": 2})


def test_a_transpose_without_perm_is_a_miss(graphs):
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"]),
        helper.make_node("Transpose", ["t"], ["y"], perm=[1, 0]),
    ]
    m = graphs.load(nodes, [("x", [3, 4])], ["y"])
    plan, _, ops = graphs.apply(m, ["onnx.transpose_pair"])
    assert ops == ["Transpose", "Transpose"] and any(
        "without perm" in x.reason for x in plan.misses
    )
