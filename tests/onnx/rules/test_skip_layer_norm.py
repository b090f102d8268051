from onnx import helper


def _ln(src, dst):
    return helper.make_node(
        "LayerNormalization", [src, "gamma", "beta"], [dst], axis=-1, epsilon=1e-6
    )


def test_residual_add_and_layer_norm_fuse_and_the_sum_feeds_its_other_readers(graphs):
    """A pre-LN block: h = x + a; y = h + W LN(h). The sum h is read by the second residual
    too, which then takes SkipLayerNormalization's fourth output."""
    nodes = [
        helper.make_node("Add", ["x", "a"], ["h"]),
        _ln("h", "n"),
        helper.make_node("MatMul", ["n", "w"], ["f"]),
        helper.make_node("Add", ["h", "f"], ["y"]),
    ]
    inits = {"gamma": graphs.weight(8) + 1, "beta": graphs.weight(8), "w": graphs.weight(8, 8)}
    m = graphs.load(nodes, [("x", ["batch", "seq", 8]), ("a", ["batch", "seq", 8])], ["y"], inits)
    plan, out, ops = graphs.apply(m, ["onnx.skip_layer_norm"])
    assert plan.counts() == {"onnx.skip_layer_norm": 1}
    assert ops == ["SkipLayerNormalization", "MatMul", "Add"]
    skip = out.graph.node[0]
    assert len(skip.output) == 4 and skip.output[3] in out.graph.node[2].input
    assert graphs.matches(m, out, {"batch": 1, "seq": 1}, {"batch": 3, "seq": 10})


def test_a_broadcast_add_is_a_miss(graphs):
    nodes = [helper.make_node("Add", ["x", "pos"], ["h"]), _ln("h", "y")]
    inits = {"gamma": graphs.weight(8), "beta": graphs.weight(8), "pos": graphs.weight(1, 5, 8)}
    m = graphs.load(nodes, [("x", ["batch", 5, 8])], ["y"], inits)
    plan, _, ops = graphs.apply(m, ["onnx.skip_layer_norm"])
    assert "SkipLayerNormalization" not in ops
    assert any("broadcasts" in x.reason for x in plan.misses)


def test_the_dense_layers_bias_goes_into_the_fused_op(graphs):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["p"]),
        helper.make_node("Add", ["p", "bias"], ["d"]),
        helper.make_node("Add", ["d", "x"], ["h"]),
        _ln("h", "y"),
    ]
    inits = {
        "w": graphs.weight(8, 8),
        "bias": graphs.weight(8),
        "gamma": graphs.weight(8),
        "beta": graphs.weight(8),
    }
    m = graphs.load(nodes, [("x", ["batch", "seq", 8])], ["y"], inits)
    plan, out, ops = graphs.apply(m, ["onnx.skip_layer_norm"])
    assert ops == ["MatMul", "SkipLayerNormalization"] and len(out.graph.node[1].input) == 5
    assert graphs.matches(m, out, {"batch": 1, "seq": 4}, {"batch": 2, "seq": 9})
