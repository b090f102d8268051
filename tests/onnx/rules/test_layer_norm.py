import numpy as np
from onnx import helper


def _decomposed(g, opset, axes=(-1,)):
    """LayerNorm as exporters before opset 17 write it; ReduceMean's axes are an attribute
    before opset 18 and an input from 18 on."""

    def mean(src, dst):
        if opset < 18:
            return [helper.make_node("ReduceMean", [src], [dst], axes=list(axes))]
        name = f"{dst}_axes"
        return [
            helper.make_node("Constant", [], [name], value_ints=list(axes)),
            helper.make_node("ReduceMean", [src, name], [dst]),
        ]

    return [
        g.const("two", 2.0),
        g.const("eps", 1e-5),
        *mean("x", "mu"),
        helper.make_node("Sub", ["x", "mu"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["d2"]),
        *mean("d2", "var"),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["n"]),
        helper.make_node("Mul", ["n", "gamma"], ["ng"]),
        helper.make_node("Add", ["ng", "beta"], ["y"]),
    ]


def _inits(g, n=10):
    return {"gamma": g.weight(n) + 1, "beta": g.weight(n)}


def test_decomposed_layer_norm_at_opset_13_and_18(graphs):
    for opset in (13, 18):
        m = graphs.load(
            _decomposed(graphs, opset),
            [("x", ["batch", "seq", 10])],
            ["y"],
            _inits(graphs),
            opset=opset,
        )
        plan, out, ops = graphs.apply(m, ["onnx.layer_norm"])
        assert plan.counts() == {"onnx.layer_norm": 1} and ops == ["LayerNormalization"], (
            opset,
            ops,
        )
        assert graphs.matches(m, out, {"batch": 1, "seq": 1}, {"batch": 3, "seq": 17})


def test_a_norm_over_another_axis_is_a_miss(graphs):
    m = graphs.load(
        _decomposed(graphs, 13, axes=(1,)), [("x", [2, 10, 10])], ["y"], _inits(graphs), opset=13
    )
    plan, _, ops = graphs.apply(m, ["onnx.layer_norm"])
    assert "LayerNormalization" not in ops
    assert any("axes [1]" in x.reason for x in plan.misses)


def test_a_scale_that_is_an_input_is_a_miss(graphs):
    m = graphs.load(
        _decomposed(graphs, 17),
        [("x", ["batch", 10]), ("gamma", [10])],
        ["y"],
        {"beta": np.zeros(10, np.float32)},
    )
    plan, _, _ = graphs.apply(m, ["onnx.layer_norm"])
    assert not plan.sites and any("scale is not a constant" in x.reason for x in plan.misses)
