import numpy as np
import onnx_ir as ir
from onnx import helper

from opswap.onnx.plan import to_ir
from opswap.onnx.rule import last_axis, reduce_axes, scalar
from opswap.onnx.rules.gelu import Gelu


def test_a_rule_reports_sites_and_misses_as_opswap_sites_and_misses(graphs):
    """Two GELUs, one with the wrong scale: one Site, one Miss, and no miss at the site's
    anchor from the forms of the pattern that did not match it."""

    def gelu(x, y, root):
        return [
            graphs.const(f"{y}r", root),
            graphs.const(f"{y}1", 1.0),
            graphs.const(f"{y}h", 0.5),
            helper.make_node("Div", [x, f"{y}r"], [f"{y}d"]),
            helper.make_node("Erf", [f"{y}d"], [f"{y}e"]),
            helper.make_node("Add", [f"{y}e", f"{y}1"], [f"{y}a"]),
            helper.make_node("Mul", [x, f"{y}h"], [f"{y}m"]),
            helper.make_node("Mul", [f"{y}m", f"{y}a"], [y], name=y),
        ]

    m = graphs.load(gelu("x", "g1", 2**0.5) + gelu("g1", "y", 3.0), [("x", ["batch", 4])], ["y"])
    run = Gelu().run(to_ir(m.proto))
    assert [s.anchor for s in run.sites] == ["g1"] and run.sites[0].rule == "onnx.gelu"
    assert [mi.where for mi in run.misses] == ["y"]
    assert "scaled by 3.0" in run.misses[0].reason


def test_reduce_axes_reads_the_attribute_and_the_input():
    x = ir.Value(name="x")
    old = ir.Node("", "ReduceMean", [x], attributes=[ir.AttrInt64s("axes", [-1])])
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([2], np.int64)))
    new = ir.Node("", "ReduceMean", [x, axes])
    assert reduce_axes(old) == [-1] and reduce_axes(new) == [2]
    assert last_axis([2], 3) and not last_axis([1], 3) and not last_axis([1, 2], 3)
    assert scalar(ir.Value(name="c", const_value=ir.tensor(np.array([[0.5]], np.float32)))) == 0.5


def test_unset_attributes_take_the_specs_default_at_the_models_opset():
    """Softmax's axis defaults to 1 before opset 13 and to -1 from it; LayerNormalization's
    epsilon to 1e-5; Gelu's approximate to "none"; an op the spec does not define keeps the
    rule's own default."""
    import onnx_ir as ir

    from opswap.onnx.rule import attr_float, attr_int, attr_str, spec_default

    def node(op, opset, domain="", **attrs):
        graph = ir.Graph([], [], nodes=[], opset_imports={domain: opset})
        n = ir.node(op, [], attributes=attrs, domain=domain)
        graph.append(n)
        return n

    assert attr_int(node("Softmax", 11), "axis") == 1
    assert attr_int(node("Softmax", 13), "axis") == -1
    assert attr_int(node("Softmax", 13, axis=2), "axis") == 2
    assert abs(attr_float(node("LayerNormalization", 17), "epsilon") - 1e-5) < 1e-10
    assert attr_str(node("Gelu", 20), "approximate") == "none"
    assert spec_default(node("SkipLayerNormalization", 1, "com.microsoft"), "epsilon") is None
    assert attr_float(node("SkipLayerNormalization", 1, "com.microsoft"), "epsilon", 1e-12) == 1e-12
