import numpy as np
from onnx import helper

N, H = 2, 4
D = N * H


def _attention(g, mask=False, softmax_axis=-1, bias=False):
    """Attention as the exporters write it: project, split heads ([B, S, N, H] then
    [B, N, S, H]; the key to [B, N, H, S]), scores, scale, mask, Softmax, x V, merge."""
    nodes, inits = (
        [],
        {"split": np.array([0, 0, N, H], np.int64), "merge": np.array([0, 0, D], np.int64)},
    )
    for name, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        inits[f"w{name}"] = g.weight(D, D)
        nodes += [
            helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}3"]),
            helper.make_node("Reshape", [f"{name}3", "split"], [f"{name}r"]),
            helper.make_node("Transpose", [f"{name}r"], [f"{name}4"], perm=perm),
        ]
    nodes += [
        helper.make_node("MatMul", ["q4", "k4"], ["s"]),
        g.const("c", 1 / np.sqrt(H)),
        helper.make_node("Mul", ["s", "c"], ["sc"]),
    ]
    last = "sc"
    if mask:
        nodes.append(helper.make_node("Add", ["sc", "m"], ["sm"]))
        last = "sm"
    nodes += [
        helper.make_node("Softmax", [last], ["p"], axis=softmax_axis),
        helper.make_node("MatMul", ["p", "v4"], ["o4"]),
        helper.make_node("Transpose", ["o4"], ["o"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["o", "merge"], ["y"]),
    ]
    inputs = [("x", ["batch", "seq", D])] + ([("m", ["batch", 1, 1, "seq"])] if mask else [])
    return nodes, inputs, inits


def test_attention_becomes_multi_head_attention(graphs):
    nodes, inputs, inits = _attention(graphs)
    m = graphs.load(nodes, inputs, ["y"], inits)
    plan, out, ops = graphs.apply(m, ["onnx.attention"])
    assert plan.counts() == {"onnx.attention": 1}
    assert ops.count("MultiHeadAttention") == 1 and "Softmax" not in ops
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    assert {a.name: helper.get_attribute_value(a) for a in mha.attribute}["num_heads"] == N
    assert graphs.matches(m, out, {"batch": 1, "seq": 1}, {"batch": 3, "seq": 13})


def test_an_additive_padding_mask_becomes_the_attention_bias(graphs):
    nodes, inputs, inits = _attention(graphs, mask=True)
    m = graphs.load(nodes, inputs, ["y"], inits)
    plan, out, ops = graphs.apply(m, ["onnx.attention"])
    assert ops.count("MultiHeadAttention") == 1 and "Expand" in ops
    assert graphs.matches(m, out, {"batch": 1, "seq": 3}, {"batch": 2, "seq": 11})


def test_a_softmax_over_the_queries_is_a_miss(graphs):
    nodes, inputs, inits = _attention(graphs, softmax_axis=2)
    m = graphs.load(nodes, inputs, ["y"], inits)
    plan, _, ops = graphs.apply(m, ["onnx.attention"])
    assert "MultiHeadAttention" not in ops
    assert any("Softmax is over axis 2" in x.reason for x in plan.misses)


def test_the_projections_biases_go_into_multi_head_attention(graphs):
    nodes, inputs, inits = _attention(graphs, bias=True)
    m = graphs.load(nodes, inputs, ["y"], inits)
    plan, out, ops = graphs.apply(m, ["onnx.attention"])
    assert "Add" not in ops and ops.count("MultiHeadAttention") == 1
    assert graphs.matches(m, out, {"batch": 1, "seq": 2}, {"batch": 2, "seq": 7})
