import json

import pytest
from onnx import helper

from opswap.errors import RuleError
from opswap.onnx.plan import plan_onnx, select


def _block(g):
    """x -> MatMul + bias -> erf GELU -> + residual -> LayerNormalization."""
    nodes = [
        g.const("r", 2**0.5),
        g.const("one", 1.0),
        g.const("half", 0.5),
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Div", ["hb", "r"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["hb", "half"], ["m"]),
        helper.make_node("Mul", ["m", "a"], ["act"]),
        helper.make_node("Add", ["act", "x"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1),
    ]
    inits = {"w": g.weight(8, 8), "b": g.weight(8), "gamma": g.weight(8), "beta": g.weight(8)}
    return g.load(nodes, [("x", ["batch", "seq", 8])], ["y"], inits)


def test_rules_run_in_order_on_what_the_earlier_ones_left(graphs):
    m = _block(graphs)
    before = m.proto.SerializeToString()
    plan, out, ops = graphs.apply(m, None)
    assert plan.counts() == {"onnx.gelu": 1, "onnx.skip_layer_norm": 1, "onnx.bias_gelu": 1}
    assert ops == ["MatMul", "BiasGelu", "SkipLayerNormalization"]
    assert m.proto.SerializeToString() == before  # the loaded model is not changed
    assert graphs.matches(m, out, {"batch": 1, "seq": 1}, {"batch": 4, "seq": 6})


def test_the_plan_serialises_with_sites_misses_and_settings(graphs, tmp_path):
    plan, _ = plan_onnx(_block(graphs), ["onnx.*gelu"])
    data = json.loads(plan.save(tmp_path / "plan.json").read_text())
    assert data["settings"]["rules"] == ["onnx.gelu", "onnx.fast_gelu", "onnx.bias_gelu"]
    assert {s["rule"] for s in data["sites"]} == {"onnx.gelu", "onnx.bias_gelu"}
    assert all({"rule", "key", "nodes", "description"} <= set(s) for s in data["sites"])


def test_globs_and_exactness_select_rules():
    assert [r.name for r in select(["onnx.layer_norm"])] == ["onnx.layer_norm"]
    assert len(select(None)) == 12
    with pytest.raises(RuleError, match="No ONNX rule matches 'fusion.conv_bn'"):
        select(["fusion.conv_bn"])
