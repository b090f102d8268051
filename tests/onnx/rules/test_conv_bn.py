from onnx import helper


def _model(g, weight_is_input=False, bias=True):
    conv_in = ["x", "w", "cb"] if bias else ["x", "w"]
    nodes = [
        helper.make_node("Conv", conv_in, ["c"], pads=[1, 1, 1, 1], group=2),
        helper.make_node("BatchNormalization", ["c", "s", "t", "mu", "var"], ["y"], epsilon=1e-3),
    ]
    inits = {
        "cb": g.weight(4),
        "s": g.weight(4) + 1,
        "t": g.weight(4),
        "mu": g.weight(4),
        "var": abs(g.weight(4)) + 0.5,
    }
    inputs = [("x", ["batch", 2, "h", "w_"])]
    if weight_is_input:
        inputs.append(("w", [4, 1, 3, 3]))
    else:
        inits["w"] = g.weight(4, 1, 3, 3)
    return g.load(nodes, inputs, ["y"], inits)


def test_batch_norm_folds_into_the_conv(graphs):
    """BatchNorm's running statistics (its state) go into the weights; grouped conv."""
    for bias in (True, False):
        m = _model(graphs, bias=bias)
        plan, out, ops = graphs.apply(m, ["onnx.conv_bn"])
        assert plan.counts() == {"onnx.conv_bn": 1} and ops == ["Conv"]
        assert graphs.matches(m, out, {"batch": 1, "h": 5, "w_": 7}, {"batch": 3, "h": 9, "w_": 4})


def test_a_weight_that_is_an_input_is_a_miss(graphs):
    m = _model(graphs, weight_is_input=True)
    plan, _, ops = graphs.apply(m, ["onnx.conv_bn"])
    assert ops == ["Conv", "BatchNormalization"]
    assert any("weight is not a constant" in x.reason for x in plan.misses)
